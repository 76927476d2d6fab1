"""The router's aux loss: the global batch's, however the rows are split over ranks, with the
single process's gradient; its step numbers and their record."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import model_with_loss

from fsdp_lab.config import LossConfig, LossKind, ModelArch, ModelConfig, ModelTask
from fsdp_lab.engine.model import build_full_model, build_hf_config
from fsdp_lab.engine.moe import MoeStep
from fsdp_lab.observe.metrics import StepMetrics, _moe_fields, _moe_row
from fsdp_lab.train import loss as loss_lib
from fsdp_lab.train.moe_loss import aux_from_sums, routing_sums

COEF = 0.5  # large: the aux loss's gradient must show in the comparison


def tiny_moe(coef: float = COEF, experts_per_token: int = 2):
    cfg = ModelConfig(
        arch=ModelArch.qwen3_moe,
        num_experts=8,
        experts_per_token=experts_per_token,
        expert_intermediate_size=32,
        vocab_size=256,
        router_aux_loss_coef=coef,
    )
    return build_full_model(build_hf_config(cfg), seed=0)


def batch(rows: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, 12), generator=gen)
    labels = ids.clone()
    labels[0, :6] = loss_lib.IGNORE_INDEX  # a prompt: its positions are not counted
    return dict(input_ids=ids, labels=labels)


def test_sums_over_ranks_give_the_aux_of_the_concatenated_batch():
    """Two ranks' sums added are the whole batch's, and the aux from them is transformers'
    load_balancing_loss_func on the concatenated logits with the same mask."""
    torch.manual_seed(0)
    logits = [torch.randn(20, 8) for _ in range(3)]  # 3 layers, 20 rows
    mask = torch.rand(20) > 0.3
    halves = [
        routing_sums([x[s] for x in logits], mask[s], num_experts=8, top_k=2)
        for s in (slice(0, 7), slice(7, 20))
    ]
    whole = routing_sums(logits, mask, num_experts=8, top_k=2)
    assert torch.allclose(halves[0] + halves[1], whole, atol=1e-6)
    aux, per_layer = aux_from_sums(halves[0] + halves[1], num_experts=8)
    hf = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    want = hf.load_balancing_loss_func(tuple(logits), 8, 2, mask.reshape(1, 20))
    assert abs(aux.item() - want.item()) <= 1e-6
    assert per_layer.sum(1).tolist() == [2.0 * mask.sum().item()] * 3  # top-2 of each row


def test_the_recomputed_forward_is_not_counted():
    """Only the loss's own forward is recorded: another forward (activation checkpointing's
    recomputation, an evaluation) leaves the aux loss and the counts alone."""
    model = tiny_moe()
    loss = loss_lib.build_loss(LossConfig(), model, kind=LossKind.hf, task=ModelTask.causal_lm)
    b = batch(3)
    one = torch.tensor(1.0)
    loss.train_value(model, b, scale=one, num_micro=1)
    want = loss.router.take()
    model(input_ids=b["input_ids"])  # outside recording
    loss.train_value(model, b, scale=one, num_micro=1)
    model(input_ids=b["input_ids"])
    got = loss.router.take()
    assert got.aux_loss.item() == want.aux_loss.item()
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    counted = 3 * 11 - 5  # every position with a target; row 0's prompt predicts nothing
    assert got.tokens_per_expert.sum().item() == 2 * 2 * counted


def _rank(rank: int, world: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, loss = model_with_loss(tiny_moe(), LossKind.chunked, LossConfig())
    full = batch(4)
    rows = {k: v[rank * 2 : rank * 2 + 2] for k, v in full.items()}
    targets = int((loss_lib.shifted_targets(full["labels"]) != -100).sum())
    value = loss.train_value(model, rows, scale=torch.tensor(world / targets), num_micro=1)
    value.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)  # FSDP's gradient average over the data-parallel ranks
    total = value.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        out["grads"], out["loss"] = grads / world, total.item() / world
    dist.destroy_process_group()


def test_two_ranks_give_the_single_process_loss_and_gradient(tmp_path):
    """The differentiable all-reduce's backward sums the ranks' gradients of the shared aux
    loss; averaged over dp as FSDP does, that is the single process's gradient exactly."""
    out = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(2, f"file://{tmp_path}/store", out), nprocs=2, start_method="fork"
    )
    model = tiny_moe()
    loss = loss_lib.build_loss(LossConfig(), model, kind=LossKind.hf, task=ModelTask.causal_lm)
    full = batch(4)
    targets = int((loss_lib.shifted_targets(full["labels"]) != -100).sum())
    value = loss.train_value(model, full, scale=torch.tensor(1 / targets), num_micro=1)
    value.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert abs(out["loss"] - value.item()) <= 1e-6
    atol = 1e-6 * want.abs().max().item()  # fp32 sums in another order: 6e-8 measured
    assert torch.allclose(out["grads"], want, rtol=0, atol=atol)
    # The aux loss's share of the routers' gradient is far above that tolerance: a rank that
    # kept only its own share (a backward without the sum) would fail the comparison.
    aux_only = tiny_moe()
    aux_loss = loss_lib.build_loss(
        LossConfig(), aux_only, kind=LossKind.hf, task=ModelTask.causal_lm
    )
    aux_loss.train_value(aux_only, full, scale=torch.tensor(0.0), num_micro=1).backward()
    assert aux_only.model.layers[0].mlp.gate.weight.grad.abs().max() > 100 * atol


def test_the_record_reports_the_worst_layers_imbalance():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [10.0, 2.0, 2.0, 2.0]])
    moe = MoeStep(aux_loss=torch.tensor(2.5), tokens_per_expert=counts)
    fields = _moe_fields(_moe_row(moe), moe)
    assert fields == {
        "aux_loss": 2.5,
        "expert_load_imbalance": pytest.approx(2.5),
        "expert_load_per_layer": [1.0, pytest.approx(2.5)],
    }
    dense = StepMetrics(1, 5.0, 1.0, 1e-3, 0.1, 100.0, 10, 0, [0])
    assert "aux_loss" not in dense.as_record()
    assert StepMetrics(1, 5.0, 1.0, 1e-3, 0.1, 100.0, 10, 0, [0], **fields).as_record()[
        "expert_load_imbalance"
    ] == pytest.approx(2.5)
