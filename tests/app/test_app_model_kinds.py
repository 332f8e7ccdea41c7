"""What each model is, as the model page lists it: the family by the name people know (gpt-oss,
Qwen3.5-MoE, GLM-4.5, DeepSeek-V2) and the size in parameters, all and active, from the headers of
real tiny GGUF files and safetensors folders."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from app.model_files import inspect_model
from app.model_kind import describe, params_text
from app.model_scan import find_models
from app.wizard import MODEL, SetupWizard

EMBED, EXPERTS, USED, EXPERT = 64 * 16, 8, 2, 8 * 16  # elements: the embedding; each expert's matrix


def write_moe_gguf(path: Path, arch: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_file_type(1)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float16))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((EXPERTS, 8, 16), dtype=np.float16))
    w.add_tensor("blk.0.ffn_up_shexp.weight", np.ones((8, 16), dtype=np.float16))  # shared: always runs
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe_folder(folder: Path, model_type: str, experts_key: str, nested: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = {"model_type": model_type, experts_key: EXPERTS, "num_experts_per_tok": USED, "max_position_embeddings": 4096}
    cfg = {"model_type": model_type.removesuffix("_text"), "text_config": text} if nested else text
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {"model.embed_tokens.weight": np.ones((64, 16), dtype=np.float16),
               "model.layers.0.mlp.shared_expert.up_proj.weight": np.ones((8, 16), dtype=np.float16)}
    for e in range(EXPERTS):
        tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = np.ones((8, 16), dtype=np.float16)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


TOTAL = EMBED + EXPERTS * EXPERT + EXPERT
ACTIVE = EMBED + USED * EXPERT + EXPERT
SIZE = f"{params_text(TOTAL)} parameters, {params_text(ACTIVE)} active"


@pytest.mark.parametrize("arch, family", [("gpt-oss", "gpt-oss"), ("qwen35moe", "Qwen3.5-MoE"),
                                          ("glm4moe", "GLM-4.5"), ("deepseek2", "DeepSeek-V2")])
def test_a_gguf_file_says_its_family_and_size(tmp_path, arch, family):
    info = inspect_model(write_moe_gguf(tmp_path / f"{arch}.gguf", arch))
    assert (info.params, info.active_params) == (TOTAL, ACTIVE)
    assert describe(info) == f"{family} · {SIZE}"


@pytest.mark.parametrize("model_type, key, nested, family", [
    ("gpt_oss", "num_local_experts", False, "gpt-oss"), ("qwen3_5_moe_text", "num_experts", True, "Qwen3.5-MoE"),
    ("glm4_moe", "n_routed_experts", False, "GLM-4.5"), ("deepseek_v2", "n_routed_experts", False, "DeepSeek-V2")])
def test_a_model_folder_says_its_family_and_size(tmp_path, model_type, key, nested, family):
    info = inspect_model(write_moe_folder(tmp_path / model_type, model_type, key, nested))
    assert (info.params, info.active_params) == (TOTAL, ACTIVE)
    assert describe(info) == f"{family} · {SIZE}"


def test_mxfp4_blocks_count_two_weights_a_byte_and_scales_none(tmp_path):
    folder = tmp_path / "gpt-oss-mxfp4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_local_experts": 4,
                                                    "num_experts_per_tok": 2}))
    save_file({"model.embed_tokens.weight": np.ones((4, 8), dtype=np.float16),
               "model.layers.0.mlp.experts.down_proj_blocks": np.ones((4, 8, 1, 16), dtype=np.uint8),
               "model.layers.0.mlp.experts.down_proj_scales": np.ones((4, 8, 1), dtype=np.uint8)},
              str(folder / "model.safetensors"))
    info = inspect_model(folder)
    assert info.params == 32 + 4 * 8 * 16 * 2 and info.active_params == 32 + 2 * 8 * 16 * 2


def test_the_model_page_shows_what_each_one_is(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    mine = tmp_path / "models"
    write_moe_gguf(mine / "gpt-oss-20b-Q4.gguf", "gpt-oss")
    write_moe_folder(mine / "GLM-4.5-Air", "glm4_moe", "n_routed_experts")
    assert len(find_models([str(mine)])[0]) == 2
    wiz = SetupWizard({"model": "builtin:smollm2-135m-moe"}, MODEL, model_folders=[str(mine)])
    qtbot.addWidget(wiz)
    wiz.show()
    page = wiz.model_page
    qtbot.waitUntil(lambda: page.found.topLevelItemCount() == 2, timeout=30_000)
    rows = {page.found.topLevelItem(i).text(0): page.found.topLevelItem(i).text(1) for i in range(2)}
    assert rows == {"gpt-oss-20b-Q4.gguf": f"gpt-oss · {SIZE}", "GLM-4.5-Air": f"GLM-4.5 · {SIZE}"}
