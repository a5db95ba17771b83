"""Shared fixtures: tiny HF checkpoints (built once per session) and their f32 containers; the chat model
and `colibri serve` process of the server tests (one per test module)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)

from chat_server import KEY, TEMPLATE  # noqa: E402
from hf_tiny import load_hf, make_tiny_checkpoint  # noqa: E402
from serve_proc import Server  # noqa: E402

from colibri.convert.converter import convert  # noqa: E402


class Checkpoints:
    """Builds (once) tiny HF folders and containers, keyed by their settings."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def hf(self, model_type: str, fused: bool = False, **overrides) -> Path:
        key = ("hf", model_type, fused, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in self.done:
            name = f"{model_type}{'_fused' if fused else ''}_{len(self.done)}"
            self.done[key] = make_tiny_checkpoint(model_type, self.root / name, fused=fused, **overrides)
        return self.done[key]

    def coli(self, model_type: str, scheme: str = "f32", fused: bool = False, group_size: int = 32,
             **overrides) -> Path:
        key = ("coli", model_type, scheme, fused, group_size, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in self.done:
            src = self.hf(model_type, fused, **overrides)
            self.done[key] = convert(src, self.root / f"{src.name}.{scheme}.g{group_size}.coli", scheme,
                                     group_size, progress=False)
        return self.done[key]


@pytest.fixture(autouse=True)
def _cpu_engine_unless_marked_cuda(request, monkeypatch):
    """The suite tests the CPU engine, on a GPU machine too (where the planner would put the tiny models
    in VRAM and the f32 identities would hold only within rounding): tests/test_cuda.py alone sees CUDA."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CLI and server subprocesses
        if torch.cuda.is_available():
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(autouse=True)
def _plain_decoding_unless_asked(request, monkeypatch):
    """Requests that do not say decode without drafts in the suite's own engines: the default ("auto") verifies
    lookup drafts where its gate's measured times say they pay, which would make step and expert counters vary
    from run to run (never the tokens); the speculation tests ask for their mode, and the tests marked
    `default_spec` check the default."""
    if request.node.get_closest_marker("default_spec") is None:
        from colibri.api import Engine

        monkeypatch.setattr(Engine, "speculative", "off")


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def chat_model(ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(HF folder with chat_template.jinja, its f32 container)."""
    import shutil

    hf = tmp_path_factory.mktemp("srv") / "hf"
    shutil.copytree(ckpt.hf("mixtral"), hf)
    (hf / "chat_template.jinja").write_text(TEMPLATE)
    return hf, convert(hf, hf.parent / "m.coli", "f32", 32, progress=False)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    s = Server(chat_model[1], "--api-key", KEY, "--model-id", "tiny", "--slots", "4", "--ctx-size", "128",
               "--slot-save-path", str(tmp_path_factory.mktemp("slots")), "--allowed-origins", "http://ui.test")
    yield s
    err = s.stop()
    assert s.proc.returncode == 0, err


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf(chat_model):
    """transformers' model and tokenizer of the chat model."""
    from transformers import AutoTokenizer

    return load_hf(chat_model[0]), AutoTokenizer.from_pretrained(chat_model[0])
