"""The foundation: config validation, the backends, the pass manager, explain, dumps, logging, the demo CLI."""
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

import fxopt
from fxopt.passes import PASS_ORDER, registered_passes

from fxopt.config import Config, ConfigError
from fxopt.models import TinyLlamaConfig, build_demo_model

TINY = TinyLlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)


def tiny_model(**kw):
    cfg = TinyLlamaConfig(**{**TINY.__dict__, **kw})
    return build_demo_model(seed=0, cfg=cfg)


def tiny_ids(b=2, s=16):
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))


# --- config -----------------------------------------------------------------------------------------------------

def test_config_nested_and_dotted_options():
    cfg = Config.from_options({"attention.enabled": False, "w4a16": {"enabled": False},
                               "pipeline": {"stages": 2, "split_points": ["layers.1"]}})
    assert cfg.attention.enabled is False and cfg.w4a16.enabled is False
    assert cfg.pipeline.stages == 2 and cfg.pipeline.split_points == ["layers.1"]
    assert Config().attention.enabled is True  # defaults untouched


def test_config_base_is_not_mutated():
    base = Config()
    Config.from_options({"attention.enabled": False}, base=base)
    assert base.attention.enabled is True


@pytest.mark.parametrize("bad, needle", [
    ({"atention": {"enabled": False}}, "unknown fxopt option 'atention'"),
    ({"attention.enabled": "yes"}, "must be bool"),
    ({"tensor_parallel.tp": 2.0}, "must be int"),
    ({"w4a16": 3}, "takes a dict"),
    ({"enabled.x": True}, "unknown fxopt option"),
])
def test_config_rejects_bad_options_naming_valid_keys(bad, needle):
    with pytest.raises(ValueError) as e:
        Config.from_options(bad)
    assert needle in str(e.value)
    assert "attention.enabled" in str(e.value) or "takes a dict" in str(e.value)


def test_bad_option_through_torch_compile_is_a_value_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="unknown fxopt option 'attention.bogus'.*valid keys"):
        torch.compile(model, backend="fxopt_eager", options={"attention.bogus": 1})(tiny_ids())
    torch._dynamo.reset()


@pytest.mark.parametrize("bad, needle", [
    ({"tensor_parallel.tp": -3}, "'tensor_parallel.tp' must be an int >= 1, got -3"),
    ({"tensor_parallel.tp": 0}, "'tensor_parallel.tp' must be an int >= 1, got 0"),
    ({"tensor_parallel.overlap_chunks": 0}, "'tensor_parallel.overlap_chunks' must be an int >= 1"),
    ({"tensor_parallel.sequence_parallel_min_bytes": -1}, "'tensor_parallel.sequence_parallel_min_bytes' must be"),
    ({"pipeline.stages": 0}, "'pipeline.stages' must be an int >= 1"),
    ({"pipeline.microbatches": -2}, "'pipeline.microbatches' must be an int >= 1"),
    ({"pipeline.schedule": "bogus"}, "'pipeline.schedule' is 'bogus'; valid choices: GPipe, 1F1B, Interleaved1F1B"),
    ({"pipeline.split_points": ["layers.1", 3]}, "'pipeline.split_points' takes qualified module names"),
    ({"inductor_options": {"max_autotun": True}}, "'max_autotun', which is not a key of torch._inductor.config "
                                                  "(closest Inductor keys: max_autotune"),
    ({"inductor_options": {"triton.cudagraph": True}}, "closest Inductor keys: triton.cudagraphs"),
], ids=["tp-negative", "tp-zero", "overlap-chunks-zero", "sp-min-bytes-negative", "stages-zero",
        "microbatches-negative", "schedule-bogus", "split-point-not-str", "inductor-key-typo",
        "inductor-dotted-key-typo"])
def test_config_rejects_bad_values_naming_what_is_allowed(bad, needle):
    with pytest.raises(ConfigError) as e:
        Config.from_options(bad)
    assert needle in str(e.value)


def test_config_accepts_valid_values_and_inductor_keys():
    cfg = Config.from_options({"tensor_parallel.tp": 2, "pipeline.schedule": "GPipe", "pipeline.stages": 2,
                               "inductor_options": {"max_autotune": True, "triton.cudagraphs": False}})
    assert cfg.tensor_parallel.tp == 2 and cfg.pipeline.schedule == "GPipe"
    assert cfg.inductor_options == {"max_autotune": True, "triton.cudagraphs": False}


def test_backend_built_from_a_bad_config_fails_at_once():
    from fxopt.config import PipelineConfig, TensorParallelConfig

    with pytest.raises(ConfigError, match="'tensor_parallel.tp' must be an int >= 1, got -3"):
        fxopt.Backend(Config(tensor_parallel=TensorParallelConfig(tp=-3)))
    with pytest.raises(ConfigError, match="valid choices: GPipe, 1F1B, Interleaved1F1B"):
        fxopt.Backend(Config(pipeline=PipelineConfig(schedule="bogus")))
    with pytest.raises(ConfigError, match="not a key of torch._inductor.config"):
        fxopt.Backend(Config(inductor_options={"no_such_inductor_key": 1}))


def test_unknown_inductor_option_through_torch_compile_names_the_key():
    # before: Inductor's AttributeError inside BackendCompilerFailed
    with pytest.raises(ConfigError, match="'no_such_inductor_key', which is not a key of torch._inductor.config"):
        torch.compile(tiny_model(), backend="fxopt",
                      options={"inductor_options": {"no_such_inductor_key": 1}})(tiny_ids())


def test_backend_rejects_non_config():
    with pytest.raises(ConfigError):
        fxopt.Backend({"attention.enabled": False})


# --- backends and the pass manager -----------------------------------------------------------------------------

def test_registry_order_is_documented_order():
    names = [p.name for p in registered_passes()]
    assert names == [n for n in PASS_ORDER if n in names]
    assert "attention" in names and "w4a16" in names


def test_fxopt_eager_matches_eager_and_records_results():
    model = tiny_model()
    ids = tiny_ids()
    backend = fxopt.Backend(inductor=False)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids)
        ref = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert len(backend.results) == 1
    ran = [r.name for r in backend.results[0]]
    assert ran == [n for n in PASS_ORDER if n in ran] and "attention" in ran


def test_disabled_config_runs_no_pass():
    backend = fxopt.Backend(Config(enabled=False), inductor=False)
    torch.compile(tiny_model(), backend=backend)(tiny_ids())
    assert backend.results == [[]]
    torch._dynamo.reset()


@pytest.mark.slow
def test_fxopt_backend_with_inductor_matches_eager():
    model = tiny_model()
    ids = tiny_ids()
    with torch.no_grad():
        out = torch.compile(model, backend="fxopt")(ids)
        ref = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode,expect", [(None, {}), ("reduce-overhead", {"triton.cudagraphs": True}),
                                         ("max-autotune", {"max_autotune": True, "triton.cudagraphs": True}),
                                         ("max-autotune-no-cudagraphs", {"max_autotune": True})])
def test_compile_mode_reaches_inductor(monkeypatch, mode, expect):
    """torch.compile(mode=...) with backend="fxopt" means for Inductor what it means with backend="inductor"."""
    import torch._inductor.compile_fx as cfx

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen["patches"] = config_patches or {}
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    model, ids = tiny_model(), tiny_ids()
    torch._dynamo.reset()
    torch.compile(model, backend="fxopt", mode=mode)(ids)
    torch._dynamo.reset()
    assert seen["patches"] == expect


@pytest.mark.parametrize("options,expect", [({"cudagraphs": True}, {"triton.cudagraphs": True}),
                                            ({"cudagraphs": False}, {}),
                                            ({"cudagraphs": True, "inductor_options": {"max_autotune": True}},
                                             {"triton.cudagraphs": True, "max_autotune": True})])
def test_cudagraphs_option_reaches_inductor(monkeypatch, options, expect):
    """options={"cudagraphs": True} gives what mode="reduce-overhead" gives, since torch.compile refuses both."""
    import torch._inductor.compile_fx as cfx

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen["patches"] = config_patches or {}
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    model, ids = tiny_model(), tiny_ids()
    torch._dynamo.reset()
    torch.compile(model, backend="fxopt", options=options)(ids)
    torch._dynamo.reset()
    assert seen["patches"] == expect


def test_cudagraphs_option_is_validated():
    with pytest.raises(fxopt.ConfigError, match="cudagraphs"):
        fxopt.Config.from_options({"cudagraphs": "yes"})


@pytest.mark.slow
def test_backend_by_name_in_a_fresh_process_that_never_imports_fxopt():
    if "fxopt" not in entry_points(group="torch_dynamo_backends").names:
        pytest.skip("fxopt is not installed (pip install .): the entry point is what this test checks")
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: torch.softmax(x @ x.T, -1), backend='fxopt_eager')\n"
        "x = torch.randn(4, 4)\n"
        "assert torch.allclose(f(x), torch.softmax(x @ x.T, -1))\n"
        "assert 'fxopt' in sys.modules, 'backend did not come from fxopt'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ok" in res.stdout


def test_dump_dir_writes_before_and_after_each_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_DUMP_DIR", str(tmp_path))
    torch.compile(tiny_model(n_layers=1), backend="fxopt_eager")(tiny_ids())
    torch._dynamo.reset()
    files = sorted(os.listdir(tmp_path))
    assert any(f.endswith("_attention_before.py") for f in files), files
    assert any(f.endswith("_attention_after.py") for f in files), files
    text = open(tmp_path / [f for f in files if f.endswith("_attention_before.py")][0]).read()
    assert "def forward" in text


def test_pass_timing_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="fxopt"):
        torch.compile(tiny_model(n_layers=1), backend="fxopt_eager")(tiny_ids())
    torch._dynamo.reset()
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("fxopt")]
    assert any(m.startswith("pass attention:") and "ms" in m for m in msgs), msgs


def test_new_nodes_keep_meta_val():
    backend = fxopt.Backend(inductor=False)
    seen = []

    def check(gm, example_inputs):
        fn = backend(gm, example_inputs)
        seen.append(all("val" in n.meta for n in gm.graph.nodes if n.op not in ("output",)))
        return fn

    torch.compile(tiny_model(n_layers=1), backend=check)(tiny_ids())
    torch._dynamo.reset()
    assert seen == [True]


# --- explain -------------------------------------------------------------------------------------------------------

def test_explain_on_demo_model():
    report = fxopt.explain(tiny_model(), tiny_ids())
    assert set(PASS_ORDER) <= set(report.rewrites)
    assert report.graphs == 1 and report.graph_breaks == 0
    assert report.rewrites["attention"] == TINY.n_layers
    text = str(report)
    assert "attention" in text and "rewrites" in text


def test_explain_counts_graph_breaks():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    report = fxopt.explain(f, torch.randn(3))
    assert report.graphs == 2 and report.graph_breaks >= 1


def test_explain_leaves_the_users_compiled_model_alone():
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    model, ids = tiny_model(), tiny_ids()
    compiled = torch.compile(model, backend=counting)
    expect = compiled(ids)
    assert len(compiles) == 1
    for _ in range(2):  # each report is fresh: the earlier capture is not reused
        report = fxopt.explain(model, ids)
        assert report.graphs == 1 and report.rewrites["attention"] == TINY.n_layers
    assert "forward" not in model.__dict__  # the module is as it was
    torch.testing.assert_close(compiled(ids), expect)
    assert len(compiles) == 1  # no recompile: Dynamo's caches were not reset


def test_explain_keeps_dynamo_counters():
    from torch._dynamo.utils import counters

    counters["stats"]["fxopt_test_marker"] += 1

    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    assert fxopt.explain(f, torch.randn(3)).graph_breaks == 1
    assert fxopt.explain(f, torch.randn(3)).graph_breaks == 1  # the counter's growth, not its total
    assert counters["stats"]["fxopt_test_marker"] == 1


def test_explain_on_transformers_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = tiny_ids()
    report = fxopt.explain(model, input_ids=ids)
    assert report.graphs >= 1
    assert report.rewrites["attention"] + sum(1 for s in report.skipped if s.pass_name == "attention") >= 2
    print(report)


# --- demo CLI and test helpers --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_demo_cli_runs_and_reports(capsys):
    from fxopt.cli import main

    assert main(["demo", "--layers", "1", "--seq", "16", "--iters", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "passes applied" in out and "max |fxopt - eager|" in out and "weight memory" in out
    assert "attention 1" in out


def _allreduce_body(rank, world_size):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == sum(range(1, world_size + 1))


@pytest.mark.slow
def test_run_on_ranks_gloo():
    from fxopt.testing import run_on_ranks

    run_on_ranks(_allreduce_body, 2)


def _failing_body(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")


@pytest.mark.slow
def test_run_on_ranks_reports_failures():
    from fxopt.testing import run_on_ranks

    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_on_ranks(_failing_body, 2)
