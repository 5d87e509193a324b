"""The hook's parts on their own: the config, the frame-size protocol, the step's agreement."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradwire.hook import CommHookState, HookConfig
from gradwire.core.frames import FrameSizes
from gradwire.core.group import BufferTarget, Entry, Group, flat_positions

from .distributed import run_workers


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("decay", [-0.1, 1.5, True, "0.5", float("nan")])
def test_feedback_decay_outside_zero_one_is_refused(decay: object) -> None:
    with pytest.raises(ValueError, match=r"feedback_decay=.* must be a number in \[0, 1\]"):
        HookConfig(compressor="topk", density=0.05, feedback_decay=decay)
    with pytest.raises(ValueError, match="feedback_decay=0.5 is not supported with momentum_correction"):
        HookConfig(compressor="topk", density=0.05, feedback_decay=0.5, momentum_correction=0.9)


def test_decayed_error_feedback_keeps_beta_times_what_was_not_sent() -> None:
    """e <- β (x - sent): with β = 0.5 the residual is half the unsent part, sent entries owe
    nothing, and β = 0 keeps nothing at all (plain top-k without memory)."""
    import torch

    from gradwire.core.feedback import ErrorFeedback

    grad = torch.tensor([1.0, -2.0, 3.0, 0.5])
    for decay, expected in ((0.5, [0.5, 0.0, 1.5, 0.25]), (0.0, [0.0, 0.0, 0.0, 0.0]), (1.0, [1.0, 0.0, 3.0, 0.5])):
        feedback = ErrorFeedback(decay=decay)
        compensated = feedback.compensate("w", grad)
        feedback.update("w", compensated, torch.tensor([1]), torch.tensor([-2.0]))
        assert torch.equal(feedback.residual("w"), torch.tensor(expected)), decay
        again = feedback.compensate("w", grad)  # next step: grad + what is still owed
        assert torch.equal(again, grad + torch.tensor(expected))


def test_a_held_residual_is_a_copy_in_the_storage_dtype_and_replace_decays_it_in_float32() -> None:
    """Residuals an exchange computes whole wait for the step's agreement in the dtype they will
    be stored in (bfloat16: half the bytes), never aliasing the exchange's buffer; the decay is
    applied in float32 at the agreement, not in bfloat16."""
    from gradwire.core.feedback import ErrorFeedback

    error = torch.tensor([1.0 + 2 ** -10, -3.0, 0.1])  # not representable in bfloat16
    for storage, decay in ((None, 1.0), (torch.bfloat16, 1.0), (torch.bfloat16, 0.3)):
        feedback = ErrorFeedback(storage_dtype=storage, decay=decay)
        held = feedback.held_copy(error, torch.float32)
        assert held.dtype == (storage or torch.float32) and held.data_ptr() != error.data_ptr()
        error_before = error.clone()
        feedback.replace("w", held)
        assert torch.equal(error, error_before)
        expected = (error.to(storage or torch.float32).float() * decay).to(storage or torch.float32)
        assert torch.equal(feedback.residual("w"), expected), (storage, decay)
        assert feedback.residual("w").dtype == (storage or torch.float32)


def test_every_compared_option_reaches_the_description() -> None:
    """Changing any field not marked rank-local changes describe(), so the cross-rank check sees it."""
    base = HookConfig(compressor="topk", density=0.05)
    changes = {"compressor": "sampled-topk", "density": 0.1, "value_codec": "fp16", "index_codec": "rice",
               "codec_options": {"degree": 2}, "error_feedback": False, "momentum_correction": 0.9,
               "scope": "global", "collective": "allgather", "hierarchy": 2, "seed": 7, "warmup_steps": 3,
               "nonfinite": "skip", "verify": "none", "link_gbit": 10.0, "link_alpha": 1e-5,
               "residual_dtype": "bfloat16", "feedback_decay": 0.5}
    compared = {f.name for f in dataclasses.fields(HookConfig) if not f.metadata.get("rank_local")}
    assert compared - {"k", "threshold", "quantize", "quantize_block", "chunk"} == set(changes)
    chunked = HookConfig(compressor="chunktopk", density=0.05)  # only a chunked sparsifier takes a chunk
    assert chunked.replace(chunk=64).describe() != chunked.describe() and "chunk" not in base.describe()
    dense = HookConfig(compressor="none")  # the quantized exchange is dense: compared on its own base
    assert dense.replace(quantize="int8").describe() != dense.describe()
    assert dense.replace(quantize="int8", quantize_block=64).describe() != dense.replace(quantize="int8").describe()
    # options added later are left out at their default: older checkpoints' option hash still matches
    assert "quantize" not in base.describe() and "residual_dtype" not in base.describe()
    assert "feedback_decay" not in base.describe()
    for name, value in changes.items():
        if name == "codec_options":
            changed = HookConfig(compressor="topk", density=0.05, value_codec="polyfit", codec_options=value)
            assert changed.describe() != HookConfig(compressor="topk", density=0.05, value_codec="polyfit").describe()
            continue
        assert base.replace(**{name: value}).describe() != base.describe(), name
    assert base.replace(log_every=5, collective_timeout=9.0).describe() == base.describe()


@pytest.mark.parametrize("options, message", [
    ({"compressor": "topq"}, "compressor='topq' is not supported; allowed:"),
    ({"scope": "model"}, "scope='model' is not supported; allowed: layer, global"),
    ({"collective": "bcast"}, "collective='bcast' is not supported; allowed:"),
    ({"nonfinite": "ignore"}, "nonfinite='ignore' is not supported; allowed: raise, skip"),
    ({"verify": "sha"}, "verify='sha' is not supported; allowed: digest, none"),
    ({"warmup_steps": -1}, "warmup_steps=-1 must be"),
    ({"collective_timeout": 0}, "collective_timeout=0 must be"),
    ({"hierarchy": 0}, "hierarchy=0 is not supported"),
    ({"compressor": "topk", "collective": "allreduce"}, "needs a shared support"),
    ({"compressor": "randomk", "collective": "allreduce", "value_codec": "qsgd"}, "value_codec must be one of"),
    ({"compressor": "none", "quantize": "int2"}, "quantize='int2' is not supported; allowed: None, int8, int4"),
    ({"compressor": "topk", "quantize": "int8"}, "quantize='int8' is a dense exchange of quantized blocks: it needs"),
    ({"compressor": "none", "quantize": "int8", "quantize_block": 0}, "quantize_block=0 must be an integer >= 1"),
])
def test_invalid_options_name_the_option(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HookConfig(**options)


def test_state_takes_a_config_or_keywords_and_reads_options_from_it() -> None:
    config = HookConfig(compressor="randomblock", density=0.2)
    state = CommHookState(config=config)
    assert state.compressor == "randomblock" and state.density == 0.2 and state.config is config
    assert CommHookState(compressor="randomblock", density=0.2).describe() == state.describe()
    with pytest.raises(ValueError, match="either config= or options"):
        CommHookState(config=config, density=0.3)


# ------------------------------------------------------------------------------------ frames
def test_frames_start_unknown_then_follow_the_longest_payload() -> None:
    frames = FrameSizes(headroom=0.1, slack_bytes=64, shrink=0.95)
    assert frames.capacity("a") is None
    assert frames.learn("a", [100, 1000, 500]) == 1100 + 64
    assert frames.learn("a", [2000, 10, 10]) == 2200 + 64  # grows at once
    assert frames.learn("a", [10, 10, 10]) == int(2264 * 0.95)  # shrinks by at most 5% per step
    assert frames.capacity("b") is None and len(frames) == 1


def test_frames_forget_and_reset() -> None:
    frames = FrameSizes()
    frames.learn("a", [10])
    frames.learn("b", [10])
    frames.forget("a")
    assert frames.capacity("a") is None and frames.capacity("b") is not None
    frames.reset()
    assert len(frames) == 0


def test_frames_refuse_bad_parameters() -> None:
    with pytest.raises(ValueError, match="shrink"):
        FrameSizes(shrink=0)


# ------------------------------------------------------------------------------------ groups
def test_group_signature_follows_layout() -> None:
    buffer = torch.zeros(10)
    group = Group(BufferTarget([buffer]), entries=[Entry("w", 3, buffer[:6], 0), Entry("b", 4, buffer[6:], 6)])
    assert group.signature() == (10, 3, 4)
    assert group.output_buffer(torch.float32).data_ptr() == buffer.data_ptr()


# ------------------------------------------------------------------ unused parameters (DDP)
class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(8, 8)
        self.used = torch.nn.Linear(8, 2)
        self.spare = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        return (self.spare if use_spare else self.used)(torch.relu(self.trunk(x)))


def worker_unused(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradwire

    model = DDP(_TwoHeads(), find_unused_parameters=True)
    state = gradwire.CommHookState(compressor="topk", density=0.25, collective="allgather", model=model)
    model.register_comm_hook(state, gradwire.comm_hook)
    names = {id(p): n for n, p in model.named_parameters()}
    keys = {n: k for k, n in names.items()}
    generator = torch.Generator().manual_seed(rank)
    # step 0 uses the spare head (builds its residual); steps 1-3 leave it unused on every rank
    for step in range(4):
        model.zero_grad()
        model(torch.randn(4, 8, generator=generator), use_spare=step == 0).sum().backward()
        if step == 0:
            owed = state.feedback.residual(keys["module.spare.weight"]).clone()
    # plain lists: tensors in a multiprocessing queue travel as file descriptors of a dead process
    return {"owed_before": owed.tolist(), "owed_after": state.feedback.residual(keys["module.spare.weight"]).tolist()}


def test_unused_parameters_keep_their_whole_residual() -> None:
    for result in run_workers(worker_unused, 2, timeout=90):
        assert any(value != 0 for value in result["owed_before"])  # something was owed after step 0
        assert result["owed_before"] == result["owed_after"]  # and none of it was lost


def test_a_zeroed_buffer_target_skips_one_zero_fill_and_a_write_clears_the_flag() -> None:
    """``BufferTarget.zeroed`` (the native selection zeroed the bucket as it read it) saves the
    output's zero-fill once; anything written afterwards makes the next output zero-fill again."""
    import torch

    from gradwire.core.group import BufferTarget

    buffer = torch.ones(8)
    target = BufferTarget([buffer])
    target.zeroed = True
    out = target.output(torch.float32)
    assert out.data_ptr() == buffer.data_ptr() and torch.equal(buffer, torch.ones(8))  # trusted, not refilled
    assert not target.zeroed
    target.zeroed = True
    target.write(torch.full((8,), 2.0))
    assert not target.zeroed
    assert torch.equal(target.output(torch.float32), torch.zeros(8))


def test_flat_positions_shift_each_entry_by_its_offset() -> None:
    indices = [torch.tensor([0, 4]), torch.zeros(0, dtype=torch.int64), torch.tensor([1]), torch.tensor([2, 3, 9])]
    offsets = [0, 10, 10, 100]
    assert flat_positions(indices, offsets).tolist() == [0, 4, 11, 102, 103, 109]
    with pytest.raises(ValueError, match="no entries"):
        flat_positions([], [])
