"""The single-process simulator: the same numbers as a real 2-rank gloo DDP run, and its plug points."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradwire.harness.simulate import exact_mean, simulate
from gradwire.harness.workloads import build_workload

from .distributed import run_workers

DATA = "pystdlib:max_bytes=65536,held_out_bytes=4096"
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
#: a short run with a large enough step size that a wrong average or wrong shard would show
RUN = {"batch_size": 4, "lr": 1e-2, "seed": 3}
STEPS = 3


def _ddp_rank(rank: int, world_size: int) -> dict:
    """One rank of ``gradwire train``'s own loop (train_method) on the default 509k-parameter gpt."""
    from gradwire.harness.training import TrainConfig, train_method

    config = TrainConfig(methods=["allreduce"], model="gpt", data=DATA, optimizer="adamw", lr=RUN["lr"],
                         batch_size=RUN["batch_size"], seed=RUN["seed"], max_steps=STEPS, progress=False)
    summary = train_method(config, "allreduce")
    return {"held_out_loss": summary["held_out_loss"], "final_loss": summary["last_step_loss"],
            "steps": summary["steps"]}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_two_simulated_workers_match_a_two_rank_gloo_ddp_run() -> None:
    ranks = run_workers(_ddp_rank, 2, timeout=50)
    assert [r["steps"] for r in ranks] == [STEPS, STEPS]
    simulated = simulate(2, STEPS, model="gpt", data=DATA, optimizer="adamw", **RUN)
    # each worker's last batch loss is the loss its rank saw: the same shards in the same order
    assert simulated.final_worker_losses == pytest.approx([r["final_loss"] for r in ranks], rel=1e-5)
    assert simulated.held_out_loss == pytest.approx(ranks[0]["held_out_loss"], rel=1e-5)
    assert ranks[0]["held_out_loss"] == ranks[1]["held_out_loss"]  # DDP kept the ranks identical
    # the tolerance is far below what a wrong reduction changes: worker 0's gradient alone
    alone = simulate(2, STEPS, model="gpt", data=DATA, optimizer="adamw", reduce=lambda grads: list(grads[0]), **RUN)
    assert abs(alone.held_out_loss - simulated.held_out_loss) > 1e3 * 1e-5 * simulated.held_out_loss


def test_exact_mean_is_the_fp32_mean_per_parameter() -> None:
    grads = [[torch.full((2, 3), 1.0), torch.tensor([2.0])], [torch.full((2, 3), 3.0), torch.tensor([-4.0])]]
    mean = exact_mean(grads)
    assert [m.shape for m in mean] == [(2, 3), (1,)]
    assert torch.equal(mean[0], torch.full((2, 3), 2.0)) and torch.equal(mean[1], torch.tensor([-1.0]))


def test_reduce_and_after_step_plug_in_local_steps() -> None:
    """``reduce`` returning None lets each worker step on its own gradient (the replicas drift
    apart); an ``after_step`` that averages the parameters every 2 steps brings them back."""
    workload = build_workload("gpt", DATA, model_options=TINY)
    seen: list[int] = []
    drift: list[float] = []

    def average_every_2(step: int, models, optimizers) -> None:
        seen.append(step)
        pairs = list(zip(*(m.parameters() for m in models)))
        drift.append(max(float((a - b).detach().abs().max()) for a, b in pairs))
        if step % 2 == 0:
            with torch.no_grad():
                for tied in pairs:
                    mean = torch.stack(tied).mean(0)
                    for parameter in tied:
                        parameter.copy_(mean)

    result = simulate(2, 4, batch_size=4, workload=workload, reduce=lambda grads: None, after_step=average_every_2)
    assert seen == [1, 2, 3, 4]
    assert all(d > 0 for d in drift)  # own gradients: the replicas differ after every step
    assert math.isfinite(result.held_out_loss) and len(result.train_loss) == 4
    ddp = simulate(2, 4, batch_size=4, workload=workload, after_step=lambda step, models, optims: drift.append(
        max(float((a - b).detach().abs().max()) for a, b in zip(*(m.parameters() for m in models)))))
    assert drift[-4:] == [0.0] * 4  # exact averaging keeps them bit-identical
    assert ddp.held_out_loss != result.held_out_loss
    assert workload.model.head.weight.grad is None  # the workload's own model is left untouched


def test_evaluations_speed_and_json() -> None:
    workload = build_workload("gpt", DATA, model_options=TINY)
    lines: list[str] = []
    result = simulate(2, 5, batch_size=4, workload=workload, eval_every=2, log=lines.append)
    assert [e["step"] for e in result.evaluations] == [0, 2, 4, 5]
    assert len(lines) == 4 and lines[-1].startswith("step 5/5: held-out loss ")
    assert result.steps_per_second > 0 and result.data["fingerprint"].startswith("pystdlib-py")
    assert json.loads(json.dumps(result.to_dict()))["held_out_loss"] == result.held_out_loss


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 0}, "workers=0 must be an integer >= 1"),
    ({"optimizer": "adam"}, "optimizer='adam' is not supported"),
    ({"lr": -1.0}, "lr=-1.0 must be > 0"),
    ({"batch_size": 10_000}, "larger than each worker's share"),
    ({"reduce": lambda grads: [grads[0][0]]}, "reduce returned 1 tensors"),
])
def test_bad_arguments_raise_value_error(kwargs: dict, message: str) -> None:
    workload = build_workload("gpt", DATA, model_options=TINY)
    arguments = {"workers": 2, "steps": 1, "batch_size": 4, "workload": workload, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate(**arguments)


def test_the_command_prints_evaluations_and_writes_json(tmp_path, capsys) -> None:
    from gradwire.cli.main import main

    assert main(["simulate", "--workers", "2", "--steps", "2", "--batch-size", "4", "--data", DATA,
                 "--eval-every", "1", "--json", str(tmp_path / "sim.json")]) == 0
    out = capsys.readouterr().out
    assert "step 1/2: held-out loss" in out and "final held-out loss (nats/byte):" in out
    record = json.loads((tmp_path / "sim.json").read_text())
    assert record["workers"] == 2 and record["parameters"] == 509_248 and len(record["evaluations"]) == 3
    assert record["environment"]["torch"] == torch.__version__ and record["environment"]["threads"] >= 1
    assert main(["simulate", "--optimizer", "sgdd"]) == 2
    err = capsys.readouterr().err
    assert err == "gradwire simulate: --optimizer='sgdd' is not supported; allowed: sgd, adamw\n"


def test_a_diloco_record_holds_theta_before_the_final_synchronize(tmp_path, capsys) -> None:
    """Dense outer steps end in sync on a sync step, so the harness's synchronize exchanges nothing
    and θ before it is the final θ; with ``unsent=model`` the workers hold θ minus their unsent part,
    so it exchanges once more and moves θ."""
    from gradwire.cli.main import main

    sparse = "+topk:density=0.1,values=fp16,indices=rice,collective=allgather"
    records = {}
    for name, method in (("dense", "diloco:sync_every=2"), ("sparse", "diloco:sync_every=2,unsent=model" + sparse)):
        assert main(["simulate", "--workers", "2", "--steps", "4", "--batch-size", "4", "--data", DATA,
                     "--method", method, "--json", str(tmp_path / f"{name}.json")]) == 0
        records[name] = json.loads((tmp_path / f"{name}.json").read_text())
    out = capsys.readouterr().out
    assert "before the final synchronize (a no-op): held-out loss" in out
    assert "before the final synchronize (which exchanged): held-out loss" in out
    dense, sparse_record = records["dense"], records["sparse"]
    assert dense["outer_steps"] == sparse_record["outer_steps"] == 2
    assert dense["before_final_synchronize"]["synchronize_exchanged"] is False
    assert dense["before_final_synchronize"]["held_out_loss"] == dense["held_out_loss"]
    assert sparse_record["before_final_synchronize"]["synchronize_exchanged"] is True
    assert sparse_record["before_final_synchronize"]["held_out_loss"] != sparse_record["held_out_loss"]


def test_an_fsdp_record_holds_its_bytes_against_plain_fsdp2_over_the_whole_run(tmp_path, capsys) -> None:
    """One exact warm-up step then one int8 step: the run's bytes are the mean of plain FSDP2's
    (ratio 1) and int8's (about 0.258), so a budget over the run sees the warm-up."""
    from gradwire.cli.main import main

    assert main(["simulate", "--workers", "2", "--steps", "2", "--batch-size", "4", "--data", DATA,
                 "--eval-every", "2", "--fsdp", "quantize:bits=8,warmup_steps=1",
                 "--json", str(tmp_path / "sim.json")]) == 0
    record = json.loads((tmp_path / "sim.json").read_text())["fsdp"]
    assert record["plain_bytes_per_step"] >= 4 * 509_248 / 2  # (p-1)/p of the padded float32 gradient
    assert 0.62 < record["bytes_vs_plain"] < 0.64, record
    out = capsys.readouterr().out
    assert "x plain FSDP2's reduce-scatter" in out
    assert "--fsdp quantize:bits=8,warmup_steps=1: " in out and "allreduce:" not in out  # whose bytes they are


def test_the_fsdp_momentum_exchange_is_simulated_with_its_optimizer(tmp_path, capsys, monkeypatch) -> None:
    """``--fsdp SPEC,warmup_steps=N,momentum=b1`` runs MomentumAdamW's steps (OneBitAdamW: v frozen
    after N) on the reduce of each worker's momentum; a wrong optimizer or spec is one line."""
    from gradwire.cli.main import main
    from gradwire.harness import optimizers

    built: list = []
    real = optimizers.OneBitAdamW

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(optimizers, "OneBitAdamW", recording)
    spec = "topk:density=0.1,values=fp16,indices=rice,warmup_steps=1,momentum=0.9"
    assert main(["simulate", "--workers", "2", "--steps", "3", "--batch-size", "4", "--data", DATA,
                 "--eval-every", "3", "--fsdp", spec, "--json", str(tmp_path / "sim.json")]) == 0
    assert len(built) == 2 and all(o.freeze_after == 1 and o.steps_taken == 3 for o in built)
    record = json.loads((tmp_path / "sim.json").read_text())
    assert record["fsdp"]["spec"] == spec and 0.2 < record["fsdp"]["bytes_vs_plain"] < 0.6, record["fsdp"]
    capsys.readouterr()
    for arguments, message in (
            (["--optimizer", "sgd", "--fsdp", spec], "momentum= is 1-bit Adam's exchange; it needs --optimizer adamw"),
            (["--fsdp", "topk:density=0.1,momentum=0.9"], "momentum= needs warmup_steps >= 1"),
            (["--fsdp", "topk:density=0.1,ef=false,warmup_steps=1,momentum=0.9"],
             "momentum= needs plain error feedback"),
            (["--fsdp", "quantize:bits=8,warmup_steps=1,momentum=0.9"], "quantize has no option 'momentum'")):
        assert main(["simulate", "--data", DATA, *arguments]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
