"""fsdp-lab plan: ZeRO figures by hand, FSDP2's exact shards on a fake process group, activations
against what autograd saves (measured CPU runs: tests/integration/test_plan_runs.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import fused_twin
from plan_cases import BIG_VOCAB, MEDIUM
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab.config import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    LossKind,
    ModelArch,
    ModelConfig,
    ModelTask,
    compose,
    strategies,
)
from fsdp_lab.config.families import preset_family
from fsdp_lab.data import corpus
from fsdp_lab.engine import activations, finetune, fsdp, precision, wrap
from fsdp_lab.engine import mesh as engine_mesh
from fsdp_lab.engine import model as model_lib
from fsdp_lab.planning import activation_memory, memory, plan, plan_result
from fsdp_lab.tools import cli
from fsdp_lab.train import loss as loss_lib
from fsdp_lab.train.optim import build_optimizer, resolve_implementation


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020, figure 1: 7.5B parameters, N=64, K=12."""
    psi = 7_500_000_000
    figures = [memory.zero_paper(psi, stage=s, dp_size=64).total for s in (0, 1, 2, 3)]
    assert [round(f / 1e9, 1) for f in figures] == [120.0, 31.4, 16.6, 1.9]


def test_zero_paper_by_hand():
    # Psi=1000, N=8: stage 2 = 2Psi + 2Psi/N + 12Psi/N; stage 3 = 16Psi/N.
    z2 = memory.zero_paper(1000, stage=2, dp_size=8)
    assert (z2.params, z2.grads, z2.optimizer) == (2000, 250, 1500)
    z3 = memory.zero_paper(1000, stage=3, dp_size=8)
    assert (z3.params, z3.grads, z3.optimizer, z3.total) == (250, 250, 1500, 2000)


@pytest.mark.parametrize("dim0", [1, 2, 5, 7, 64, 100, 127, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 48, 128])
def test_chunk_rows_is_fsdp2_chunking(dim0, n):
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    chunks = _chunk_with_empty(torch.empty(dim0, device="meta"), n, dim=0)
    assert [memory.chunk_rows(dim0, n, r) for r in range(n)] == [c.shape[0] for c in chunks]


def test_fsdp2_state_is_the_papers_16_bytes_regrouped():
    """Default llama_tiny on 2 ranks, every dim 0 even: fp32 shard 4 + grad 4 + Adam 8 bytes per
    parameter over N, plus a 4-byte step per tensor; the paper's stage 3 is 16 Psi / N."""
    p = plan.build_plan(["hardware=cpu"])
    psi, tensors = p.num_params, 21  # 9 per layer x 2, norm, embedding, head
    full, grad_op, no_shard = (p.strategies[s] for s in ("full", "grad_op", "no_shard"))
    assert (
        full.per_rank
        == [
            memory.StateBytes(
                params=2 * psi,
                grads=2 * psi,
                optimizer=4 * psi + 4 * tensors,
                padding=0,
                grad_padding=0,
            )
        ]
        * 2
    )
    assert full.zero_paper.state.total == 8 * psi
    assert full.rank0.params + full.rank0.grads + full.rank0.optimizer == (
        full.zero_paper.state.total + 4 * tensors
    )
    # FSDP2's grad_op holds full's state at rest; its gathered params are the transient.
    assert grad_op.per_rank == full.per_rank
    assert grad_op.transient.kept_params == 4 * psi > full.transient.kept_params
    assert no_shard.rank0 == memory.StateBytes(
        params=4 * psi,
        grads=4 * psi,
        optimizer=8 * psi + 4 * tensors,
        padding=0,
        grad_padding=0,
    )
    assert isinstance(p.strategies["hybrid"], plan_result.Unavailable)
    assert "4+ ranks" in p.strategies["hybrid"].reason


def test_128_ranks_planned_on_a_laptop():
    p = plan.build_plan(
        [
            "hardware=gpu",
            "hardware.num_nodes=16",
            "hardware.nproc_per_node=8",
            "sharding=hybrid",
            "precision=bf16",
        ]
    )
    assert (p.world_size, p.device) == (128, "gpu")
    s = p.strategies
    assert (s["hybrid"].mesh, s["full"].mesh, s["no_shard"].mesh) == (
        (16, 8),
        (128,),
        (128, 1),
    )
    assert len(s["hybrid"].per_rank) == 128
    assert all(s["hybrid"].per_rank[r] == s["hybrid"].per_rank[r % 8] for r in range(128))
    # Dims of 64 over 128 ranks: the last ranks hold empty shards but padded storage.
    last, first = s["full"].per_rank[127], s["full"].per_rank[0]
    assert last.params < first.params and last.padding > 0 == first.padding
    assert [(s[k].zero_paper.stage, s[k].zero_paper.dp_size) for k in s] == [
        (3, 128),
        (2, 128),
        (0, 1),
        (3, 8),
        (2, 8),
    ]
    assert not any("assumed" in a and "per node" in a for a in p.assumptions)


@pytest.mark.parametrize("visible,want", [(0, 8), (4, 4)])
def test_gpus_per_node_default_to_the_visible_ones_or_eight(monkeypatch, visible, want):
    from fsdp_lab.engine.hardware import devices

    monkeypatch.setattr(devices, "default_nproc_per_node", lambda kind: visible)
    p = plan.build_plan(["hardware=gpu"])
    assert p.nproc_per_node == want
    assert any("assumed 8 per node" in a for a in p.assumptions) == (visible == 0)


def test_cli_text_and_json(capsys, tmp_path):
    # an empty cache: the step is priced on the cpu row, whatever the session has measured
    cache = f"hardware.profile_cache={tmp_path}"
    assert cli.main(["plan", "sharding=grad_op", "hardware.nproc_per_node=4", cache]) == 0
    text = capsys.readouterr().out
    memory_table, time_table = text.split("step time on cpu ")
    rows = [
        line
        for line in memory_table.splitlines()
        if line[2:].split(" ")[0] in {"full", "grad_op", "no_shard", "hybrid", "hybrid_zero2"}
    ]
    assert len(rows) == 5 and rows[1].startswith("* grad_op") and "(4,)" in rows[1]
    assert "* grad_op" in time_table and " ms " in time_table  # each strategy's step, predicted
    assert "ZeRO paper" in text and "not counted:" in text
    assert cli.main(["plan", "--json", "sharding=hybrid", "hardware.nproc_per_node=4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "hybrid" and data["strategies"]["hybrid"]["mesh"] == [2, 2]
    assert set(data["strategies"]["hybrid"]["per_rank"][3]) == {
        "params",
        "grads",
        "optimizer",
        "padding",
        "grad_padding",
    }
    assert data["not_counted"] and data["units"]["count"] == 3


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["sharding=nope"], "sharding"),
        (["hardware=cpu", "sharding=hybrid"], "4+ ranks"),
        (["trainer.no_such_key=1"], "no_such_key"),
        (["trainer.seq_len=4096"], "trainer.seq_len"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, overrides, words):
    assert cli.main(["plan", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp-lab: error:") and words in err and err.count("\n") == 1


# --- exact per-rank state on a fake process group (any world size, one process) ------------


def sharded_rank(overrides: list[str]):
    """The worker's recipe (steps 2-4 and 7) on the current fake group, weights random."""
    cfg = compose(overrides)
    topo, _ = plan.topology(cfg)
    hf = model_lib.build_hf_config(
        model_lib.resolve_vocab_size(cfg.model, corpus.load_tokenizer(cfg))
    )
    kind = loss_lib.resolve_loss(cfg.loss, hf, cfg.model.task, topo.device, compiled=False)
    model, loss = loss_lib.meta_model_with_loss(cfg, hf, kind, compiled=False)
    mesh = engine_mesh.build_mesh(cfg.sharding, topo, device_type="cpu")
    experts = fsdp.apply_expert_parallel(model, cfg, topo, mesh)  # parallel.expert > 1
    selected = wrap.select_units(model, cfg.wrap)
    units = activations.apply_activation_checkpointing(
        model,
        [u for u in selected if not fsdp.is_expert_unit(u, experts)],
        cfg.activation_checkpointing,
    )
    fsdp.apply_fsdp(
        model,
        units,
        mesh=mesh,
        reshard_after_forward=strategies.reshard_after_forward(cfg.sharding),
        mp_policy=precision.build_mp_policy(cfg.precision),
        offload_policy=None,
        prefetch=cfg.sharding.prefetch,
        experts=experts,
    )
    model.to_empty(device="cpu")
    # transformers' own init under seed 0, then the weights and tokens below from where it left
    # the generator: the draws the live-peak tolerances were measured with (bf16_pure Qwen2's
    # peak moves with them: 0.76-0.93x the plan over other draws).
    torch.manual_seed(0)
    buffers = dict(model_lib._from_config(hf, cfg.model.task).named_buffers())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
        for name, b in model.named_buffers():  # rotary inv_freq, BERT's position ids
            b.copy_(buffers[activations.clean_name(name)])
    ids = torch.randint(0, hf.vocab_size - 1, (cfg.trainer.micro_batch_size, cfg.trainer.seq_len))
    optimizer = build_optimizer(
        model,
        cfg.optim,
        implementation=resolve_implementation(
            cfg.optim, topo.device, grad_scaler=cfg.precision.grad_scaler_enabled
        ),
    )
    return model, optimizer, dict(input_ids=ids, labels=ids), cfg, loss


def storage_bytes(tensors) -> int:
    seen = {
        t.to_local().untyped_storage().data_ptr(): t.to_local().untyped_storage().nbytes()
        for t in tensors
    }
    return sum(seen.values())


@pytest.mark.parametrize(
    "overrides,rank",
    [
        (["hardware=cpu", "hardware.nproc_per_node=3"], 2),  # uneven shards: 64 rows over 3
        (["model=bert_tiny", "hardware.nproc_per_node=7", "precision=bf16"], 6),  # empty shards
        (["model=gpt2_tiny", "sharding=grad_op", "hardware.nproc_per_node=5"], 4),
        (["sharding=hybrid_zero2", "hardware.nproc_per_node=6", "precision=bf16_pure"], 5),
        (["hardware=cpu", "model=qwen2_tiny", "sharding=no_shard"], 1),
        # frozen parameters beside trainable ones in one unit: no grads, no optimizer state
        (["finetune=lora", "hardware.nproc_per_node=3"], 2),
        (
            [
                "model=qwen2_tiny",
                "finetune=lora",
                "finetune.r=3",
                "sharding=hybrid",
                "hardware.nproc_per_node=4",
                "finetune.target_modules=[all-linear]",
            ],
            3,
        ),
        (
            [
                "finetune=freeze",
                "finetune.freeze_blocks=1",
                "finetune.freeze=[model.embed_tokens]",
                "hardware.nproc_per_node=3",
            ],
            1,
        ),
        # EP 2 x FSDP 2: whole experts on both axes
        (["model=qwen3_moe_tiny", "parallel.expert=2", "hardware.nproc_per_node=4"], 3),
        # EP 2 on 16 ranks: 4 experts a rank over 8 FSDP ranks, split on dim 1 (no empty shard)
        (["model=mixtral_tiny", "parallel.expert=2", "hardware.nproc_per_node=16"], 13),
        # EP 4 x hybrid: replicate 2 x (efsdp 2, ep 4); 2 experts a rank over 2
        (
            [
                "model=olmoe_tiny",
                "parallel.expert=4",
                "sharding=hybrid",
                "sharding.replicate_size=2",
                "hardware.nproc_per_node=16",
            ],
            6,
        ),
        # no EP: 8 experts padded over 3 ranks, as any parameter
        (["model=qwen3_moe_tiny", "hardware.nproc_per_node=3"], 2),
    ],
)
def test_state_on_a_fake_group_is_the_plan_exactly(fake_group, overrides, rank):
    expected = plan.build_plan(overrides).chosen_plan.per_rank[rank]
    fake_group(rank, plan.topology(compose(overrides))[0].world_size)
    model, optimizer, batch, _, _ = sharded_rank(overrides)
    model(**batch).loss.backward()
    optimizer.step()
    assert fsdp.state_bytes(model, optimizer) == {
        k: getattr(expected, k) for k in ("params", "grads", "optimizer")
    }
    params = list(model.parameters())
    # FSDP2's padding: each shard's storage is chunk 0's size, for params and grads alike.
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == sum(p.requires_grad for p in params)  # a frozen one has none
    assert storage_bytes(params) == expected.params + expected.padding - expected.grad_padding
    assert storage_bytes(grads) == expected.grads + expected.grad_padding


# Live tensor bytes (the profiler's count of every allocation) over two steps of the project's
# train_step, against the plan's peak less the state already there: measured 0.99-1.06 here and
# 0.94-1.06 over 7 more configs (the 1.06s: BERT's recomputation; Llama's selective
# checkpointing, where HF's KV cache grows as layers are recomputed), 1.00 for GPT-2, BERT,
# Qwen2 and Llama with a large vocabulary (the root unit's end of backward). The tolerance: 8%.
PEAK_TOLERANCE = 0.08
QUARTER = ["trainer.micro_batch_size=2"]


@pytest.mark.parametrize(
    "overrides,rank",
    [
        ([*MEDIUM, "sharding=full"], 0),
        ([*MEDIUM, "model=gpt2_tiny", "sharding=grad_op", "hardware.nproc_per_node=3"], 2),
        # the end of backward is the peak: three V x H gradients of the tied embedding at once
        ([*BIG_VOCAB, "model=gpt2_tiny", "model.num_heads=4", "loss=hf"], 1),
        # the root's gradient buffers are not added to the forward peak (planned 1.45x before)
        ([*BIG_VOCAB, "sharding=full"], 0),
        # bf16 on a CPU without native bf16 matmuls is slow: make test, not test-fast; and for
        # qwen2 a quarter of the batch (BERT's is kept: at micro_batch_size=2 its peak is 15%
        # over the plan, measured 29.9 MB live against 25.9 MB planned).
        pytest.param(
            [*MEDIUM, "model=bert_tiny", "precision=bf16", "activation_checkpointing=full"],
            0,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            [
                *MEDIUM,
                "model=qwen2_tiny",
                "trainer.grad_accum_steps=2",
                "precision=bf16_pure",
                *QUARTER,
            ],
            0,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_live_peak_on_a_fake_group_within_tolerance(fake_group, monkeypatch, overrides, rank):
    from torch.profiler import ProfilerActivity, profile

    from fsdp_lab.train.loop import train_step

    # A fake group copies nothing: plan it as a backend with a reduce-scatter of its own (NCCL),
    # not as gloo (tests/integration/test_plan_runs.py measures that one).
    gloo_reduce_scatter = memory.reduce_scatter_bytes
    monkeypatch.setattr(
        memory,
        "reduce_scatter_bytes",
        lambda numel, r, **kw: gloo_reduce_scatter(numel, dataclasses.replace(r, gloo=False), **kw),
    )
    expected = plan.build_plan(overrides)
    s = expected.chosen_plan
    fake_group(rank, expected.world_size)
    model, optimizer, batch, cfg, loss = sharded_rank(overrides)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):
            train_step(
                model,
                [batch] * cfg.trainer.grad_accum_steps,
                targets=expected.world_size * batch["labels"][:, 1:].numel(),
                dp=expected.world_size,
                optimizer=optimizer,
                scaler=None,
                grad_clip=1.0,
                loss=loss,
            )
    live = peak = 0
    for e in sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    ):
        live += e.nbytes()
        peak = max(peak, live)
    estimate = s.peak_over_start(rank)
    assert abs(peak / estimate - 1) <= PEAK_TOLERANCE, (peak, estimate)


# --- activations against what autograd saves ------------------------------------------------


def small_model(arch: ModelArch, dtype: torch.dtype, ac: str = "none", num_kv_heads: int = 2):
    """A preset on CPU with params in ``dtype`` (as FSDP2's param_dtype casts them; buffers stay
    fp32), its layers checkpointed as fsdp_lab does, and the plan's layer shape."""
    family = preset_family(arch)
    task = family.task
    cfg = ModelConfig(
        arch=arch,
        task=task,
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_layers=3,
        num_heads=8,
        num_kv_heads=num_kv_heads,
        tie_word_embeddings=arch is not ModelArch.llama,
        # MoE presets: 8 experts of width 96 (top-2), the dense presets none
        num_experts=8 * family.experts,
        expert_intermediate_size=96,
    )
    hf = model_lib.build_hf_config(cfg)
    model = model_lib.build_full_model(hf, seed=0, task=task)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    ac_cfg = ActivationCheckpointingConfig(mode=ActivationCheckpointingMode[ac])
    activations.apply_activation_checkpointing(model, finetune.blocks(model), ac_cfg)
    return (
        model,
        activation_memory.layer_shape(hf, task)[0],
        len(activations.checkpointed_indices(ac_cfg, 3)),
    )


def saved_bytes(model, batch) -> int:
    """Bytes autograd saves for backward in one forward, each storage once, weights excluded;
    a DTensor (tensor parallelism) counts its local shard."""

    def storage(t):
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()

    weights = {storage(p).data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if storage(t).data_ptr() not in weights:
            seen[storage(t).data_ptr()] = storage(t).nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(seen.values())


class _Storages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes(), s.data_ptr()))
        return out


def live_bytes_after_forward(model, batch) -> int:
    """Bytes made in forward and still alive when backward starts, weights and loss excluded:
    what checkpointing keeps too (its inputs, which saved-tensor hooks inside it never see)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with _Storages() as mode:
        loss = model(**batch).loss
    live = sum(n for ref, n, ptr in mode.made.values() if not ref.expired() and ptr not in weights)
    loss.backward()
    return live - loss.untyped_storage().nbytes()


# Measured here (3 layers, hidden 128, 8 heads / 2 KV heads, 3 x 96 tokens): the estimate is
# within 0.4% of the saved bytes without checkpointing and 0.9% of the live bytes with it, the
# rest being BERT's int buffers (position and token-type ids) that it does not count.
ACTIVATION_TOLERANCE = 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ModelArch), ids=[a.name for a in ModelArch])
def test_activations_are_what_autograd_saves(arch, dtype):
    model, shape, _ = small_model(arch, dtype)
    ids = torch.randint(0, 250, (3, 96))
    measured = saved_bytes(model, dict(input_ids=ids, labels=ids))
    estimate = activation_memory.activations(
        shape,
        activation_memory.RankBatch(batch=3, seq_len=96, b=dtype.itemsize),
        num_checkpointed=0,
    ).saved
    assert abs(estimate / measured - 1) <= ACTIVATION_TOLERANCE, (estimate, measured)


def _hf_layout(name: str):
    """Transformers configs the presets do not cover: dropout at the library's default 0.1
    (the presets set it to 0), and NeoX's layout (LayerNorm, fused qkv, partial rotary)."""
    from transformers import BertConfig, GPT2Config, GPTNeoXConfig, LlamaConfig

    sizes = dict(vocab_size=256, hidden_size=128, num_hidden_layers=3, num_attention_heads=8)
    neox = dict(intermediate_size=384, max_position_embeddings=128, **sizes)
    match name:
        case "gpt2-dropout":
            return GPT2Config(
                vocab_size=256, n_embd=128, n_layer=3, n_head=8, bos_token_id=0, eos_token_id=1
            )
        case "neox":
            return GPTNeoXConfig(**neox)
        case "neox-serial-dropout":
            return GPTNeoXConfig(
                use_parallel_residual=False, hidden_dropout=0.1, attention_dropout=0.1, **neox
            )
        case "bert-dropout":
            return BertConfig(intermediate_size=384, **sizes)
        case "llama-attention-dropout":  # the math path repeats k and v to every head
            return LlamaConfig(
                intermediate_size=384, num_key_value_heads=2, attention_dropout=0.1, **sizes
            )
    raise ValueError(name)


# Measured here (3 x 96 tokens): within 0.04%, the rest NeoX's per-layer rotary tables.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "name",
    ["gpt2-dropout", "neox", "neox-serial-dropout", "bert-dropout", "llama-attention-dropout"],
)
def test_dropout_and_neox_activations_are_what_autograd_saves(name, dtype):
    """On CPU a dropout keeps a noise tensor of its input's dtype, and attention dropout takes
    sdpa's math path (fp32 probabilities, their noise, the dropped ones)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    hf = _hf_layout(name)
    hf.use_cache = False
    task = ModelTask.masked_lm if name.startswith("bert") else ModelTask.causal_lm
    auto = AutoModelForMaskedLM if task is ModelTask.masked_lm else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(hf).to(dtype).train()
    ids = torch.randint(0, 250, (3, 96))
    measured = saved_bytes(model, dict(input_ids=ids, labels=ids))
    estimate = activation_memory.activations(
        activation_memory.layer_shape(hf, task)[0],
        activation_memory.RankBatch(batch=3, seq_len=96, b=dtype.itemsize, cpu_kernels=True),
        num_checkpointed=0,
    ).saved
    assert abs(estimate / measured - 1) <= ACTIVATION_TOLERANCE, (estimate, measured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "arch", [ModelArch.llama, ModelArch.qwen2, ModelArch.gpt2], ids=["llama", "qwen2", "gpt2"]
)
def test_activations_with_a_fused_loss(arch, dtype):
    """loss=chunked saves the head weight's gradient and the hidden states' instead of the
    log-softmax over the vocabulary; in forward it holds one chunk's logits at a time."""
    model, shape, _ = small_model(arch, dtype)
    chunk = 64
    model = fused_twin(model, LossKind.chunked, chunk)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    ids = torch.randint(0, 250, (3, 96))
    measured = saved_bytes(model, dict(input_ids=ids, labels=ids))
    fused = activation_memory.activations(
        shape,
        activation_memory.RankBatch(batch=3, seq_len=96, b=dtype.itemsize),
        num_checkpointed=0,
        loss_chunk=chunk,
    )
    hf = activation_memory.activations(
        shape,
        activation_memory.RankBatch(batch=3, seq_len=96, b=dtype.itemsize),
        num_checkpointed=0,
    )
    assert abs(fused.saved / measured - 1) <= ACTIVATION_TOLERANCE, (fused.saved, measured)
    assert fused.loss_grad == chunk * shape.vocab * 8 < hf.loss_grad


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_activations_under_tensor_parallelism_are_what_autograd_saves(fake_group, tp, sp):
    """One rank of a TP group on a fake group: TP splits attention and the MLP, sequence
    parallelism the norms too (each DTensor counted by its local shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.config import ParallelConfig
    from fsdp_lab.engine import tensor_parallel

    fake_group(0, tp)
    model, shape, _ = small_model(ModelArch.llama, torch.float32, num_kv_heads=4)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    tensor_parallel.apply(model, mesh, ParallelConfig(tensor=tp, sequence_parallel=sp))
    ids = torch.randint(0, 250, (3, 96))
    measured = saved_bytes(model, dict(input_ids=ids, labels=ids))
    estimate = activation_memory.activations(
        shape,
        activation_memory.RankBatch(batch=3, seq_len=96, b=4, tensor=tp, sequence_parallel=sp),
        num_checkpointed=0,
    ).saved
    whole = activation_memory.activations(
        shape, activation_memory.RankBatch(batch=3, seq_len=96, b=4), num_checkpointed=0
    ).saved
    assert abs(estimate / measured - 1) <= ACTIVATION_TOLERANCE, (estimate, measured)
    assert measured < whole


@pytest.mark.parametrize("cp,rank", [(2, 0), (4, 3)])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activations_under_context_parallelism_are_what_autograd_saves(
    fake_group, cp, rank, packed, dtype
):
    """One rank of a CP group: its chunks of every row, each layer's gathered keys and values,
    SDPA's chunk outputs and masks (a packed row's document masks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.data.context import CONTEXT_DOCUMENTS, split_sequences
    from fsdp_lab.engine import context_parallel

    fake_group(rank, cp)
    model, shape, _ = small_model(ModelArch.llama, dtype)
    context_parallel.apply(model, init_device_mesh("cpu", (cp,), mesh_dim_names=("context",)))
    ids = torch.randint(0, 250, (3, 96))
    rows = {"input_ids": ids, "labels": ids}
    if packed:
        rows |= {"position_ids": torch.arange(96) % 40, "sequence_index": torch.arange(96) // 40}
        rows = {k: v.expand(3, 96) for k, v in rows.items()}
    batch = split_sequences(rows, context=cp, rank=rank, causal=True)
    split = context_parallel.ContextSplit(batch.pop(CONTEXT_DOCUMENTS, None))
    measured = saved_bytes(model, dict(batch, context_split=split))
    estimate = activation_memory.activations(
        shape,
        activation_memory.RankBatch(
            batch=3,
            seq_len=96,
            b=dtype.itemsize,
            context=activation_memory.ContextLayout(cp, dense_masks=True, rows_masked=packed),
            cpu_kernels=True,
        ),
        num_checkpointed=0,
    ).saved
    whole = activation_memory.activations(
        shape,
        activation_memory.RankBatch(batch=3, seq_len=96, b=dtype.itemsize),
        num_checkpointed=0,
    ).saved
    assert abs(estimate / measured - 1) <= ACTIVATION_TOLERANCE, (estimate, measured)
    assert measured < whole / cp * 1.2  # about 1/N of the whole, plus the gathered K/V


@pytest.mark.parametrize("ac", ["full", "selective", "op"])
@pytest.mark.parametrize(
    "arch,dtype",
    [
        (ModelArch.llama, torch.bfloat16),
        (ModelArch.gpt2, torch.float32),
        (ModelArch.bert, torch.bfloat16),
    ],
    ids=["llama", "gpt2", "bert"],
)
def test_activations_with_checkpointing(arch, dtype, ac):
    model, shape, num_checkpointed = small_model(arch, dtype, ac)
    ids = torch.randint(0, 250, (3, 96))
    measured = live_bytes_after_forward(model, dict(input_ids=ids, labels=ids))
    estimate = activation_memory.activations(
        shape,
        activation_memory.RankBatch(batch=3, seq_len=96, b=dtype.itemsize),
        num_checkpointed=num_checkpointed,
        op=ac == "op",
    ).saved
    assert abs(estimate / measured - 1) <= 2 * ACTIVATION_TOLERANCE, (estimate, measured)


# --- the estimate against real runs (train.py, gloo ranks on this CPU) ----------------------


def test_tpu_is_not_planned(capsys):
    """The memory model is FSDP2's; on tpu XLA decides the buffers: one line, exit 2."""
    assert cli.main(["plan", "hardware=tpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdp-lab: error:") and "hardware=gpu" in err and "\n" not in err


def test_host_ram_to_load_and_export_per_rank_and_node(tmp_path):
    """The seeds' 70B on 8 GPUs: rank 0's whole-model route is the model in fp32 (280 GB);
    per rank it is a tensor's slice, and a random init one decoder layer drawn whole."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    ).save_pretrained(tmp_path)
    gpus = ["model=local", f"model.name_or_path={tmp_path}", "hardware=gpu"]
    got = plan.build_plan([*gpus, "hardware.nproc_per_node=8"])
    h, total = got.host, got.num_params
    assert h.load_rank0 >= 4 * total and 4 * total / h.load > 500  # 258 GiB against 0.24
    assert h.state == 0 and h.export_other == 0  # on the GPUs; rank 0 writes one tensor
    assert h.export_writer == 2 * 4 * 32000 * 8192
    assert h.per_node == h.export_writer + 7 * h.load
    drawn = plan.build_plan([*gpus, "hardware.nproc_per_node=8", "model.pretrained=false"]).host
    layer = 4 * 8192 * (8192 * 2 + 1024 * 2 + 3 * 28672) + 2 * 4 * 8192  # its norms too
    assert drawn.load == layer
    offloaded = plan.build_plan([*gpus, "hardware.nproc_per_node=8", "offload=cpu"])
    assert offloaded.host.state == offloaded.chosen_plan.rank0.total
    text = plan.format_plan(got)
    assert "host RAM per rank" in text and "per node (8 ranks)" in text
    assert got.to_json()["host"]["load_peak"] == h.load


def test_the_planning_entry_is_the_plan(tmp_path):
    from fsdp_lab import planning

    overrides = ["sharding=grad_op", f"hardware.profile_cache={tmp_path}"]
    assert planning.plan_config(overrides).to_json() == plan.build_plan(overrides).to_json()
