"""llama-cpp-python's OpenAI server, the peer of tests/server, loaded with the llama.cpp backend's
guard against the AMX repacking crash (engine.backends.llamacpp.amx_repack_off):
`python -m tests.llamacpp_server` takes the arguments of `python -m llama_cpp.server`."""

import llama_cpp
from llama_cpp.server.__main__ import main

from engine.backends.llamacpp import amx_repack_off

if __name__ == "__main__":
    with amx_repack_off(llama_cpp):
        main()
