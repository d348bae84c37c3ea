import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lcsm.inference.accel import native
from lcsm.inference.accel.block_exit import CompileError
from lcsm.inference.decode import fold_norm, new_decode_state, rms_scale
from tests.conftest import needs_compiler
from tests.lcsm.conftest import TINY_ARGS as ARGS
from tests.lcsm.conftest import tiny_hyena


@pytest.fixture(scope="module")
def model():
    m = tiny_hyena()
    for p in m.parameters():  # nonzero biases and norm weights, so that a wrongly folded one shows
        if p.dim() == 1:
            torch.nn.init.normal_(p, std=0.5)
    return m


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("engine,options", [("lazy", {}), ("eager", {}), ("recompute", {}),
                                            ("flash", {"tau": "fft", "block": 1}), ("flash", {})])
@pytest.mark.parametrize("P", [1, 2, 3, 11, 24])
def test_prefill_then_decode_equals_parallel_forward(model, tokens, engine, options, P):
    state = new_decode_state(model, engine, 2, **options)
    logits = [state.prefill(tokens[:, :P])]
    logits += [state.step(tokens[:, t])[:, None] for t in range(P, ARGS.max_seq_len)]
    torch.testing.assert_close(torch.cat(logits, 1), model(tokens), rtol=0, atol=1e-10)


def test_decode_from_the_first_token_without_prefill(model, tokens):
    """The first K - 1 positions see the short conv's zero padding, in_proj's bias included."""
    state = new_decode_state(model, "flash", 2)
    logits = torch.stack([state.step(tokens[:, t]) for t in range(ARGS.max_seq_len)], 1)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=1e-10)


def test_logits_of_earlier_steps_are_not_overwritten(model, tokens):
    state = new_decode_state(model, "lazy", 2)
    first = state.step(tokens[:, 0])
    kept = first.clone()
    state.step(tokens[:, 1])
    assert torch.equal(first, kept)


@needs_compiler
@pytest.mark.parametrize("engine,options,P,B", [("flash", {}, 3, 2), ("flash", {"native_step": False}, 1, 2),
                                                ("lazy", {}, 11, 1), ("eager", {}, 1, 2)])
def test_native_decode_equals_parallel_forward(model, tokens, engine, options, P, B):
    """block_exit in C; at B = 2 the gates are strided views, and the engine steps run in C or as tensor ops.
    Where they run in C (flash, and lazy at B = 1), the whole token is one C call."""
    state = new_decode_state(model, engine, B, decode="native", **options)
    assert (state.c_token is not None) == (engine in ("flash", "lazy") and options.get("native_step") is not False)
    logits = [state.prefill(tokens[:B, :P])]
    logits += [state.step(tokens[:B, t])[:, None] for t in range(P, ARGS.max_seq_len)]
    torch.testing.assert_close(torch.cat(logits, 1), model(tokens[:B]), rtol=0, atol=1e-10)


@needs_compiler
def test_native_decode_in_float32_and_its_logits_are_fresh(tokens):
    model = tiny_hyena().float()
    state = new_decode_state(model, "flash", 2, decode="native")
    logits = [state.step(tokens[:, t]) for t in range(ARGS.max_seq_len)]
    assert len({x.data_ptr() for x in logits}) == len(logits)
    torch.testing.assert_close(torch.stack(logits, 1), model(tokens), rtol=1e-4, atol=1e-4)


@needs_compiler
def test_native_decode_in_one_call_refuses_bad_tokens_in_one_line_and_stays_put(model, tokens):
    state = new_decode_state(model, "flash", 2, decode="native")
    assert state.c_token is not None
    state.prefill(tokens[:, :3])
    for bad, message in [(torch.tensor([1, ARGS.vocab_size]), rf"tokens must be in \[0, {ARGS.vocab_size}\)"),
                         (torch.tensor([-1, 0]), "tokens must be in"),
                         (torch.tensor([1, 2, 3]), r"tokens must be integers of shape \(2,\)"),
                         (torch.tensor([1.0, 2.0]), "tokens must be integers")]:
        with pytest.raises(ValueError, match=message):
            state.step(bad)
        assert state.pos == state.engine.pos == 3
    logits = [state.step(tokens[:, t])[:, None] for t in range(3, ARGS.max_seq_len)]
    torch.testing.assert_close(torch.cat(logits, 1), model(tokens)[:, 3:], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="all .* positions are used"):
        state.step(tokens[:, 0])


def test_native_decode_without_a_compiler_names_the_other_decodes(model, monkeypatch):
    monkeypatch.setattr(native, "block_exit", lambda device, dtype: None)
    with pytest.raises(CompileError, match=r"needs float32 or float64 on a CPU and a C compiler .*--decode eager or "
                                           r"compiled"):
        new_decode_state(model, "lazy", 2, decode="native")
    with pytest.raises(ValueError, match="unknown decode 'fast'; choose one of eager, compiled, native"):
        new_decode_state(model, "lazy", 2, decode="fast")


def test_second_prefill_names_the_fix(model, tokens):
    state = new_decode_state(model, "lazy", 2)
    state.prefill(tokens[:, :3])
    with pytest.raises(ValueError, match="build a new decode state"):
        state.prefill(tokens[:, :3])


@pytest.fixture(scope="module")
def compiled_states(model):
    """Builds the compiled decode step once (about 30 s on 2 cores); later states load it from the cache."""
    return lambda engine, **options: new_decode_state(model, engine, 2, decode="compiled", **options)


@needs_compiler  # AOTInductor compiles C++
@pytest.mark.parametrize("engine,P", [("flash", 3), ("lazy", 1)])
def test_compiled_decode_equals_parallel_forward(compiled_states, model, tokens, engine, P):
    state = compiled_states(engine)
    logits = [state.prefill(tokens[:, :P])]
    logits += [state.step(tokens[:, t])[:, None] for t in range(P, ARGS.max_seq_len)]
    torch.testing.assert_close(torch.cat(logits, 1), model(tokens), rtol=0, atol=1e-10)


@needs_compiler
def test_compiled_decode_is_built_once_per_shape_then_loaded(compiled_states, model, monkeypatch):
    compiled_states("lazy")  # built (or already in this session's cache)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: pytest.fail("compiled twice"))
    compiled_states("eager")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Compiler: cc is not found.")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    with pytest.raises(CompileError, match=r"failed \(RuntimeError: Compiler: cc is not found.\); .*eager\|native"):
        new_decode_state(model, "lazy", 3, decode="compiled")  # another batch size: another build, which fails


def test_folded_norm_then_projection_equals_the_modules():
    torch.manual_seed(0)
    norm, W = nn.RMSNorm(8, eps=1e-5).double(), torch.randn(5, 8, dtype=torch.float64)
    nn.init.normal_(norm.weight)
    x = torch.randn(3, 8, dtype=torch.float64)
    folded = (x * rms_scale(x, 8 * norm.eps)) @ fold_norm(norm, W)
    torch.testing.assert_close(folded, F.linear(norm(x), W), rtol=0, atol=1e-12)
