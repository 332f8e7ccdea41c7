"""The built-in GGUF requantised by llama.cpp's quantiser (Q4_K_M, Q8_0) into this folder, then the README's
question to each, greedy, on Tandem's CPU path (pin a kernel table with TANDEM_NATIVE_ISA).
    python3 requantised_builtin.py"""
import llama_cpp

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.models.builtin import smollm2_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
for name, ftype in (("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M), ("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)):
    out = f"builtin-{name}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ftype, True
    assert llama_cpp.llama_model_quantize(str(smollm2_gguf()).encode(), out.encode(), params) == 0
    engine = Engine(EngineConfig(model=out, backend="tandem", device="cpu"))
    result = engine.generate(GenerationRequest(messages=QUESTION, max_new_tokens=12, greedy=True))
    print(name, engine.info().get("weight_types"), repr(result.text), round(result.decode_tok_s, 1))
    engine.close()
