"""The loss: fused kinds against the model's own loss, the no-mask attention path, the choice
of loss.kind and its refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import fused_twin, model_with_loss, train

from fsdp_lab.config import ConfigError, HardwareKind, LossConfig, LossKind, ModelTask, families
from fsdp_lab.train import loss as loss_lib
from fsdp_lab.train.linear_ce import linear_cross_entropy


def tiny_config(model_type: str):
    """A 2-layer model of each type the fused loss takes (dropout off: it is not an fp32 run's
    randomness that is compared)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    match model_type:
        case "llama":
            return LlamaConfig(**common)
        case "mistral":
            return MistralConfig(**common)
        case "qwen2":
            return Qwen2Config(**common, tie_word_embeddings=True)
        case "qwen3":
            return Qwen3Config(**common, head_dim=16)
        case "qwen3_moe" | "mixtral" | "olmoe":
            from transformers import AutoConfig

            # Its own loss leaves the router's aux out (output_router_logits is off).
            return AutoConfig.for_model(
                model_type, **common, num_local_experts=4, num_experts_per_tok=2
            )
        case "gpt2":
            return GPT2Config(
                vocab_size=300,
                n_embd=64,
                n_layer=2,
                n_head=4,
                use_cache=False,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
    raise ValueError(model_type)


def model_and_batch(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    ids = torch.randint(0, 300, (3, 20))
    labels = ids.clone()
    labels[0, 5:9] = loss_lib.IGNORE_INDEX  # some positions predict nothing
    return model, dict(input_ids=ids, labels=labels)


# fp32, measured: one chunk gives HF's loss bit for bit (the same log_softmax and nll_loss
# kernels); several chunks differ by the fp32 chunk sums' rounding, at most 9.5e-7 here.
@pytest.mark.parametrize("chunk", [None, 7], ids=["one_chunk", "chunks_of_7"])
@pytest.mark.parametrize("model_type", families.fused_loss_types())
def test_chunked_loss_equals_the_models_own(model_type, chunk):
    ref, batch = model_and_batch(model_type)
    fused = fused_twin(ref, LossKind.chunked, chunk or loss_lib.tokens_per_chunk(LossConfig(), 300))
    want, got = ref(**batch).loss, fused(**batch).loss
    want.backward()
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-6
    if chunk is None:
        assert got.item() == want.item()
    for (name, p), q in zip(ref.named_parameters(), fused.parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-7), name
    total = fused(**batch, loss_reduction="sum").loss
    count = (loss_lib.shifted_targets(batch["labels"]) != loss_lib.IGNORE_INDEX).sum()
    assert abs(total.item() / count.item() - want.item()) <= 1e-6
    # The model's own class, a subclass of it: records name it as before; a copy is its own
    assert type(fused).__name__ == type(ref).__name__ and isinstance(fused, type(ref))
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2.0)
    assert twin(**batch).loss.item() != fused(**batch).loss.item()


@pytest.mark.parametrize("kind", [LossKind.hf, LossKind.chunked])
def test_evaluation_sums_are_the_same_whatever_the_loss(kind):
    model, batch = model_and_batch("llama")
    ref = copy.deepcopy(model)
    model, loss = model_with_loss(model, kind)
    total, count = loss.token_sums(model, batch).tolist()
    logits = ref(input_ids=batch["input_ids"]).logits[:, :-1]
    want = F.cross_entropy(
        logits.flatten(0, 1),
        batch["labels"][:, 1:].flatten(),
        ignore_index=loss_lib.IGNORE_INDEX,
        reduction="sum",
    )
    assert count == 3 * 19 - 4 and abs(total - want.item()) <= 1e-4


def test_the_chunked_loss_builds_no_full_logits():
    """Only one chunk's logits ever exist: the largest tensor the loss makes is a chunk's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    hidden = torch.randn(64, 4, requires_grad=True)
    weight = torch.randn(1000, 4, requires_grad=True)  # smaller than a chunk's logits
    targets = torch.randint(0, 1000, (64,))
    with Largest():
        linear_cross_entropy(hidden, weight, targets, chunk_size=8).backward()
    assert Largest.numel == 8 * 1000  # not 64 x 1000


def test_fp16_gradients_survive_the_grad_scalers_factor():
    """fp16 with a grad scaler: backward brings a factor of 65536 (past fp16's range) after the
    chunked loss made its gradients. They come out finite and as HF's loss makes them."""
    torch.manual_seed(0)
    hidden = torch.randn(96, 32).half().requires_grad_()
    weight = (torch.randn(2048, 32) * 0.02).half().requires_grad_()
    targets = torch.randint(0, 2048, (96,))
    (linear_cross_entropy(hidden, weight, targets, chunk_size=32) * 65536).backward()
    ref_h = hidden.detach().clone().requires_grad_()
    ref_w = weight.detach().clone().requires_grad_()
    (F.cross_entropy((ref_h @ ref_w.t()).float(), targets) * 65536).backward()
    for got, want in ((hidden.grad, ref_h.grad), (weight.grad, ref_w.grad)):
        assert got.dtype == torch.float16 and got.isfinite().all()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)


def test_chunk_size_default_is_a_power_of_two_within_the_budget():
    for vocab in (256, 32000, 49152, 128256, 151936):
        rows = loss_lib.tokens_per_chunk(LossConfig(), vocab)
        assert rows & (rows - 1) == 0 and rows * vocab * 4 <= loss_lib.CHUNK_LOGITS_BYTES < (
            2 * rows * vocab * 4
        )
    assert loss_lib.tokens_per_chunk(LossConfig(chunk_size=100), 32000) == 100


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_batches_without_a_mask_take_sdpa_causal_path(model_type, monkeypatch):
    """Packed causal batches carry no attention mask: HF then builds none and calls SDPA with
    is_causal=True (the flash path on a GPU), and the loss is the one with an all-ones mask."""
    model, batch = model_and_batch(model_type)
    model.eval()
    model = fused_twin(model, LossKind.chunked, 1024)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    plain = model(**batch).loss
    assert calls and all(mask is None and causal for mask, causal in calls)
    masked = model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).loss
    assert abs(plain.item() - masked.item()) <= 1e-6


@pytest.mark.parametrize(
    "kind,model_type,task,device,compiled,want",
    [
        (LossKind.auto, "llama", ModelTask.causal_lm, HardwareKind.cpu, False, LossKind.chunked),
        (LossKind.auto, "gpt2", ModelTask.causal_lm, HardwareKind.gpu, True, LossKind.chunked),
        (LossKind.auto, "llama", ModelTask.causal_lm, HardwareKind.tpu, False, LossKind.hf),
        (LossKind.auto, "bert", ModelTask.masked_lm, HardwareKind.cpu, False, LossKind.hf),
        (LossKind.auto, "gemma2", ModelTask.causal_lm, HardwareKind.cpu, False, LossKind.hf),
        (LossKind.hf, "llama", ModelTask.causal_lm, HardwareKind.cpu, False, LossKind.hf),
        (LossKind.chunked, "qwen2", ModelTask.causal_lm, HardwareKind.gpu, False, LossKind.chunked),
    ],
)
def test_the_loss_a_run_computes(kind, model_type, task, device, compiled, want):
    cfg = type("C", (), {"model_type": model_type})()
    assert (
        loss_lib.resolve_loss(LossConfig(kind=kind), cfg, task, device, compiled=compiled) is want
    )


def test_auto_takes_liger_on_an_eager_gpu_run_where_installed(monkeypatch):
    import importlib.util

    cfg = type("C", (), {"model_type": "llama"})()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "liger_kernel" else real(name, *a),
    )
    auto = LossConfig(kind=LossKind.auto)
    assert (
        loss_lib.resolve_loss(auto, cfg, ModelTask.causal_lm, HardwareKind.gpu, compiled=False)
        is LossKind.liger
    )
    assert (
        loss_lib.resolve_loss(auto, cfg, ModelTask.causal_lm, HardwareKind.gpu, compiled=True)
        is LossKind.chunked
    )
    assert (
        loss_lib.resolve_loss(auto, cfg, ModelTask.causal_lm, HardwareKind.cpu, compiled=False)
        is LossKind.chunked
    )


@pytest.mark.parametrize(
    "kind,model_type,task,device,fragment",
    [
        (
            LossKind.chunked,
            "bert",
            ModelTask.masked_lm,
            HardwareKind.cpu,
            "a masked LM; use loss=hf",
        ),
        (LossKind.chunked, "gemma2", ModelTask.causal_lm, HardwareKind.cpu, "model_type=gemma2"),
        (LossKind.liger, "llama", ModelTask.causal_lm, HardwareKind.cpu, "use loss=chunked"),
        (
            LossKind.cce,
            "llama",
            ModelTask.causal_lm,
            HardwareKind.gpu,
            "pip install cut-cross-entropy",
        ),
    ],
)
def test_a_loss_the_model_or_device_cannot_take_is_refused(
    kind, model_type, task, device, fragment, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("liger_kernel", "cut_cross_entropy") else real(name, *a),
    )
    cfg = type("C", (), {"model_type": model_type})()
    with pytest.raises(ConfigError) as e:
        loss_lib.resolve_loss(LossConfig(kind=kind), cfg, task, device, compiled=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["loss=liger"], "hardware=cpu cannot run loss=liger: Triton kernels run on a GPU"),
        (["loss=chunked", "model=bert_tiny"], "this is a masked LM; use loss=hf"),
        (["loss.chunk_size=0"], "loss.chunk_size=0 must be > 0"),
    ],
)
def test_train_py_refuses_before_launch(run_dir, overrides, fragment):
    proc = train(run_dir, "hardware=cpu", *overrides)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fsdp_lab: error:")]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
