"""Mixed-precision search (tpubuild/lower/search.py): the fewest tensors in float to reach a target cosine.

A small CNN is calibrated properly, then one tensor's threshold is wrecked (a
fiftieth of its range, so most of it saturates): the search must find that
tensor, keep it in float and little else, and the table must carry over to
inputs it never saw. The cosines asserted are computed here, from TPU inference
of the lowered module against TOP inference.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx
import pytest
from onnx import helper

from tpubuild.build.chips import load_chip
from tpubuild.calib.calibrate import apply_table, calibrate
from tpubuild.errors import TpuBuildError
from tpubuild.frontend import convert_onnx
from tpubuild.ir import mlir
from tpubuild.lower.lowering import lower_module
from tpubuild.lower.qtable import parse_quantize_table
from tpubuild.lower import int8 as int8_module
from tpubuild.lower import search as search_module
from tpubuild.lower.search import SearchConfig, format_result, search
from tpubuild.top.canonicalize import canonicalize
from tpubuild.top.inference import Memo, run
from tpubuild.verify.similarity import cosine

BM1684X = load_chip("bm1684x")
SHAPE = (1, 3, 16, 16)


def node(op, inputs, output, **attrs):
    return helper.make_node(op, list(inputs), [output], name=output, **attrs)


class Net:
    """conv-relu twice with a residual add, a 1x1 conv, GAP and a gemm: canonical TOP, weights, a max table."""

    def __init__(self, make_model, tmp_path):
        rng = np.random.default_rng(7)

        def w(*shape, scale):
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        nodes = [
            node("Conv", ["x", "w1", "b1"], "c1", pads=[1, 1, 1, 1]),
            node("Relu", ["c1"], "r1"),
            node("Conv", ["r1", "w2", "b2"], "c2", pads=[1, 1, 1, 1]),
            node("Relu", ["c2"], "r2"),
            node("Add", ["r1", "r2"], "res"),
            node("Conv", ["res", "w3", "b3"], "c3"),
            node("Relu", ["c3"], "r3"),
            node("GlobalAveragePool", ["r3"], "gap"),
            node("Flatten", ["gap"], "flat"),
            node("Gemm", ["flat", "wf", "bf"], "logits", transB=1),
        ]
        inits = {
            "w1": w(8, 3, 3, 3, scale=0.4),
            "b1": w(8, scale=0.1),
            "w2": w(8, 8, 3, 3, scale=0.15),
            "b2": w(8, scale=0.1),
            "w3": w(6, 8, 1, 1, scale=0.4),
            "b3": w(6, scale=0.1),
            "wf": w(5, 6, scale=0.8),
            "bf": w(5, scale=0.1),
        }
        path = tmp_path / "model.onnx"
        onnx.save(make_model(nodes, {"x": np.zeros(SHAPE, np.float32)}, initializers=inits), path)
        module, weights = convert_onnx(path, {"x": SHAPE}, "test", "origin_weights.npz")
        self.module, self.weights = canonicalize(module, weights, "canonical_weights.npz")
        self.samples = [{"x": rng.uniform(-1, 1, SHAPE).astype(np.float32)} for _ in range(10)]
        self.cali, _ = calibrate(self.module, self.weights, self.samples[:6], "max")

    def wreck(self, name: str, factor: float = 50.0) -> dict:
        cali = dict(self.cali)
        cali[name] = dataclasses.replace(cali[name], threshold=cali[name].threshold / factor)
        return cali

    def score(self, cali, qtable, samples) -> float:
        """The lowest output cosine of the INT8 lowering with ``qtable`` over ``samples``."""
        tm, tw = lower_module(
            apply_table(self.module, cali), self.weights, chip=BM1684X, mode="INT8", cali=cali, qtable=qtable
        )
        (top_out,), (tpu_out,) = mlir.output_names(self.module), mlir.output_names(tm)
        return min(
            cosine(run(tm, tw, s, all_tensors=False)[tpu_out], run(self.module, self.weights, s)[top_out])
            for s in samples
        )


@pytest.fixture
def net(make_model, tmp_path, monkeypatch) -> Net:
    # the search over every op of a small net: its pooled head would otherwise stay float (int8.vector_region)
    monkeypatch.setattr(int8_module, "vector_region", lambda lw: set())
    return Net(make_model, tmp_path)


def run_search(net: Net, cali, user=None, **config):
    return search(
        apply_table(net.module, cali),
        net.weights,
        chip=BM1684X,
        cali=cali,
        asymmetric=False,
        samples=net.samples[:3],
        config=SearchConfig(**config),
        user=user,
    )


def test_a_wrecked_tensor_is_found_and_kept_in_float(net):
    cali = net.wreck("r1")
    held_out = net.samples[6:]
    assert net.score(cali, None, held_out) < 0.9  # the damage is real
    result = run_search(net, cali, target_cos=0.99)
    assert result.reached and result.int8_score < 0.9 and result.score >= 0.99
    assert [u.tensor for u in result.chosen] == ["r1"]
    # r1's producer (the conv, with its ReLU fused) and both readers: the second conv and the add
    assert set(result.table) == {"r1", "r2", "res"} and set(result.table.values()) == {"F16"}
    # what it costs: the two 3x3 convs (27 and 72 MACs per output value, 8 x 16 x 16 of each) against those,
    # the 1x1 conv's (8 per value, 6 x 16 x 16) and the gemm's (6 per logit, 5); the Add does none
    assert result.float_macs == pytest.approx(99 * 2048 / (99 * 2048 + 8 * 1536 + 30))
    assert f"# in float: 3 ops, {result.float_macs:.1%} of the model's multiply-accumulates" in format_result(result)
    table = parse_quantize_table(format_result(result))
    assert table == result.table
    assert net.score(cali, table, held_out) >= 0.99  # it holds on inputs the search never saw


def test_pruning_stops_at_a_tenth_of_the_tensors(net, monkeypatch):
    """A segment that must stay is halved down to len(units) // PRUNE_PARTS tensors, not always to one: the
    few around a culprit stay float with it, and the lowerings saved are left for the check on the pool."""
    cali = net.wreck("r1")
    # one chunk of every tensor, so that pruning halves it; this net has fewer than PRUNE_PARTS * 2 of them
    fine = run_search(net, cali, target_cos=0.99, chunks=1)
    assert [u.tensor for u in fine.chosen] == ["r1"]
    monkeypatch.setattr(search_module, "PRUNE_PARTS", 2)
    coarse = run_search(net, cali, target_cos=0.99, chunks=1)
    assert coarse.reached and "r1" in [u.tensor for u in coarse.chosen] and len(coarse.chosen) > 1
    assert coarse.lowerings < fine.lowerings


def test_the_default_target_leaves_a_margin_for_inputs_the_search_never_saw(net):
    cali = net.wreck("r2", 3.0)
    held_out = net.samples[6:]
    at_the_line = run_search(net, cali, target_cos=0.99)
    assert at_the_line.reached and at_the_line.table == {}  # INT8 alone holds 0.99 on the samples scored
    assert net.score(cali, None, held_out) < 0.99  # and misses it on inputs the search never saw
    result = run_search(net, cali)  # the default target
    assert result.target > 0.99 and [u.tensor for u in result.chosen] == ["r2"]
    assert net.score(cali, result.table, held_out) >= 0.99


def test_a_cheap_model_gets_more_lowerings_by_default(net, monkeypatch):
    """The default bound is on cost: 60 lowerings for a model of CHEAP_MACS or more, as many more as it has fewer
    multiply-accumulates, at most MOST_LOWERINGS; a manifest's max_lowerings is kept as written."""
    from tpubuild.lower.int8 import macs

    total = sum(macs(op) for op in net.module.walk())
    assert 0 < total < search_module.CHEAP_MACS
    assert search_module.default_lowerings(net.module) == search_module.MOST_LOWERINGS
    monkeypatch.setattr(search_module, "CHEAP_MACS", 3 * total)
    assert search_module.default_lowerings(net.module) == 180
    monkeypatch.setattr(search_module, "CHEAP_MACS", total)
    assert search_module.default_lowerings(net.module) == search_module.DEFAULT_LOWERINGS == 60
    # an unreachable target spends 16 lowerings here: the bound search() takes from default_lowerings, or the
    # manifest's, ends it first
    cali = net.wreck("r2", 3.0)
    monkeypatch.setattr(search_module, "default_lowerings", lambda module: 5)
    assert run_search(net, cali, target_cos=1.0 + 1e-9).lowerings == 5
    assert run_search(net, cali, target_cos=1.0 + 1e-9, max_lowerings=9).lowerings == 9


def test_nothing_is_pinned_when_int8_already_meets_the_target(net):
    result = run_search(net, net.cali, target_cos=0.99)
    assert result.int8_score >= 0.99 and result.reached
    assert result.table == {} and result.chosen == [] and result.lowerings == 1
    assert parse_quantize_table(format_result(result)) == {}


def test_the_user_table_is_kept_and_never_re_pinned(net):
    cali = net.wreck("r1")
    result = run_search(net, cali, user={"r2": "F32"}, target_cos=0.99)
    assert result.reached
    assert result.table["r2"] == "F32" and result.table["r1"] == "F16"
    text = format_result(result)
    assert parse_quantize_table(text) == result.table
    assert "r2 F32" in text.splitlines() and "r2 F16" not in text.splitlines()


def test_an_unreachable_target_is_reported_not_hidden(net):
    """A target above what even all-float computes (F16 rounding) cannot be met: the table says so."""
    cali = net.wreck("r1")
    result = run_search(net, cali, target_cos=1.0 + 1e-9, max_lowerings=12)
    assert not result.reached and result.lowerings <= 12
    assert "TARGET NOT REACHED" in format_result(result)


def test_the_samples_scored_are_those_where_int8_alone_is_worst(net):
    """Of a pool of samples, the search scores the ones furthest from float under INT8 (computed here per sample)."""
    cali = net.wreck("r1", 10.0)
    per_sample = [net.score(cali, None, [s]) for s in net.samples]
    worst = sorted(np.argsort(per_sample, kind="stable")[:2].tolist())
    assert len({round(c, 6) for c in per_sample}) == len(per_sample)  # no ties to decide
    result = search(
        apply_table(net.module, cali),
        net.weights,
        chip=BM1684X,
        cali=cali,
        asymmetric=False,
        samples=net.samples,
        config=SearchConfig(samples=2, target_cos=0.99),
    )
    assert result.pool == len(net.samples) and list(result.scored) == worst and result.samples == 2
    assert result.int8_score == pytest.approx(min(per_sample), abs=1e-9)
    assert "of the 10 in the pool: those where INT8 alone, then each table found, is furthest" in format_result(result)
    assert result.reached and net.score(cali, result.table, net.samples) >= 0.99


def test_a_table_that_misses_the_target_elsewhere_in_the_pool_is_searched_on_there_too(net):
    """Two causes: r1 wrecked hurts every sample, r3 clipped a sixth of its range only some. The sample INT8 alone
    is furthest from float shows the first; the table that fixes it there misses the target on other samples of
    the pool (computed here), so the search scores those too and its table holds on every one of them."""
    cali = net.wreck("r1")
    cali["r3"] = dataclasses.replace(cali["r3"], threshold=cali["r3"].threshold / 6)
    module = apply_table(net.module, cali)
    per_sample = [net.score(cali, None, [s]) for s in net.samples]
    first = int(np.argmin(per_sample))

    def searched(samples):
        config = SearchConfig(samples=1, target_cos=0.99)
        return search(module, net.weights, chip=BM1684X, cali=cali, asymmetric=False, samples=samples, config=config)

    alone = searched([net.samples[first]])  # the search as it was: the table of the worst sample alone
    assert alone.reached and net.score(cali, alone.table, net.samples) < 0.99
    result = searched(net.samples)
    assert first in result.scored and result.samples > 1 and result.reached
    assert net.score(cali, result.table, net.samples) >= 0.99
    assert result.pool_score is not None and result.pool_score >= 0.99
    assert f"# on every sample of the pool: {result.pool_score:.6f}" in format_result(result)


def test_memo_runs_equal_plain_runs_and_compute_only_what_a_change_reaches(net):
    """Memo (top/inference.py), as the search uses it: INT8 lowerings that differ in the last op's mode give the
    same bits as plain runs, and the second computes only the ops from that change on."""
    cali = net.wreck("r1")
    module = apply_table(net.module, cali)
    samples = net.samples[:2]
    memo = Memo(samples)
    int8 = lower_module(module, net.weights, chip=BM1684X, mode="INT8", cali=cali)
    pinned = lower_module(module, net.weights, chip=BM1684X, mode="INT8", cali=cali, qtable={"logits": "F16"})
    computed = []
    for tm, tw in (int8, pinned, pinned):
        for i, sample in enumerate(samples):
            expect, got = run(tm, tw, sample, all_tensors=False), memo.run(tm, tw, i)
            assert got.keys() == expect.keys()
            assert all(got[k].dtype == expect[k].dtype and np.array_equal(got[k], expect[k]) for k in expect)
        computed.append(memo.computed)
    assert computed[0] >= 2 * 8  # conv, conv, add, conv, pool, flatten, gemm and more, per sample
    assert 0 < computed[1] - computed[0] <= 2 * 3  # the gemm, the cast feeding it, the output's cast
    assert computed[2] == computed[1]  # the same module again: nothing to compute
    memo.keep([1])  # the second input's tensors stay, the first's go
    expect = run(pinned[0], pinned[1], samples[1], all_tensors=False)
    got = memo.run(pinned[0], pinned[1], 1)
    assert all(np.array_equal(got[k], expect[k]) for k in expect) and memo.computed == computed[2]
    memo.run(pinned[0], pinned[1], 0)
    assert memo.computed > computed[2]


@pytest.mark.parametrize("target", [0.99, 1.0 + 1e-9])
def test_steps_score_samples_hardest_first_and_stop_below_the_target(net, monkeypatch, target):
    """A greedy or pruning step only asks whether a table reaches the target: it stops at the first sample below
    it. The search's result is the one scoring every sample gives (also when the target is out of reach and the
    best table below it is kept), with fewer sample runs when it is reached."""
    cali = net.wreck("r1")
    runs = {"n": 0}
    sample_score = search_module.Evaluator.sample_score

    def counted(self, *args):
        runs["n"] += 1
        return sample_score(self, *args)

    monkeypatch.setattr(search_module.Evaluator, "sample_score", counted)
    # two chunks, x .. res and r3 .. logits: the first reaches the target, and pruning then tries r2 and res
    # alone in float (below the target: r1 is the wrecked one) before it keeps x and r1, then r1
    fast = run_search(net, cali, target_cos=target, samples=3, chunks=2, max_lowerings=12)
    fast_runs, runs["n"] = runs["n"], 0
    monkeypatch.setattr(
        search_module._Search, "passes", lambda self, chosen, like: self.score(chosen) >= self.config.target_cos
    )
    full = run_search(net, cali, target_cos=target, samples=3, chunks=2, max_lowerings=12)
    assert fast.table == full.table and fast.score == full.score and fast.lowerings == full.lowerings
    assert [u.tensor for u in fast.chosen] == [u.tensor for u in full.chosen]
    assert format_result(fast) == format_result(full)
    if target < 1:
        assert [u.tensor for u in fast.chosen] == ["r1"]
        assert fast_runs < runs["n"]
    else:
        assert not fast.reached


@pytest.mark.parametrize("target", [0.99, 1.0 + 1e-9])
def test_two_processes_find_the_same_table(net, target):
    """The pool scored in two processes (each its half of the samples): the same scores, samples and table."""
    cali = net.wreck("r1", 10.0)
    results = [
        search(
            apply_table(net.module, cali),
            net.weights,
            chip=BM1684X,
            cali=cali,
            asymmetric=False,
            samples=net.samples,
            config=SearchConfig(samples=3, target_cos=target, max_lowerings=12),
            processes=processes,
        )
        for processes in (1, 2)
    ]
    one, two = results
    assert one.scored == two.scored and one.int8_score == two.int8_score and one.score == two.score
    assert one.table == two.table and format_result(one) == format_result(two)
    assert two.pool == len(net.samples) and (two.reached if target < 1 else not two.reached)


@pytest.mark.parametrize("target", [0.99, 1.0 + 1e-9])
def test_the_greedy_and_pruning_steps_work_ahead_in_the_second_process(net, monkeypatch, target):
    """With two processes, one evaluates the table the next step asks about if the current one falls short:
    those evaluations are used (some from the other process, some made here while it had the current table),
    and the steps, their count and the table are those of one process."""
    cali = dict(net.wreck("r1", 10.0))
    cali["r3"] = net.wreck("r3", 8.0)["r3"]  # two culprits, in different chunks: several greedy and pruning steps
    came = {"there": 0, "here": 0}
    evaluate = search_module._Search._evaluate

    def counted(self, key):
        if key in self.known:
            came["here"] += 1
        elif self.ahead is not None and self.ahead.asked == key:
            came["there"] += 1
        return evaluate(self, key)

    monkeypatch.setattr(search_module._Search, "_evaluate", counted)
    monkeypatch.setattr(search_module, "spare_core", lambda: True)  # whatever else runs on the machine now
    logs = [[], []]
    results = [
        search(
            apply_table(net.module, cali),
            net.weights,
            chip=BM1684X,
            cali=cali,
            asymmetric=False,
            samples=net.samples,
            config=SearchConfig(samples=3, chunks=8, target_cos=target, max_lowerings=20),
            log=logs[processes - 1].append,
            processes=processes,
        )
        for processes in (1, 2)
    ]
    one, two = results
    assert came["there"] > 0 and came["here"] > 0
    assert logs[0] == logs[1] and one.lowerings == two.lowerings and one.score == two.score
    assert one.table == two.table and format_result(one) == format_result(two)
    assert two.reached if target < 1 else not two.reached


def test_no_work_ahead_without_a_spare_core(net, monkeypatch):
    """A busy machine (spare_core: no): the second process is offered nothing, and the table is the same."""
    cali = dict(net.wreck("r1", 10.0))
    cali["r3"] = net.wreck("r3", 8.0)["r3"]
    sent = []
    evaluate = search_module._Search._evaluate

    def watched(self, key):
        if self.ahead is not None and self.ahead.asked is not None:
            sent.append(self.ahead.asked)
        return evaluate(self, key)

    monkeypatch.setattr(search_module, "spare_core", lambda: False)
    monkeypatch.setattr(search_module._Search, "_evaluate", watched)
    config = SearchConfig(samples=3, chunks=8, max_lowerings=20)
    one, two = (
        search(
            apply_table(net.module, cali),
            net.weights,
            chip=BM1684X,
            cali=cali,
            asymmetric=False,
            samples=net.samples,
            config=config,
            processes=processes,
        )
        for processes in (1, 2)
    )
    assert sent == [] and one.table == two.table and one.lowerings == two.lowerings


def test_a_second_process_that_dies_ahead_is_a_clear_error(net, monkeypatch):
    """The process working ahead ends without answering (killed, out of memory): the search stops with the error
    that says so and how to search in one process, not a broken pipe."""
    cali = dict(net.wreck("r1", 10.0))
    cali["r3"] = net.wreck("r3", 8.0)["r3"]

    def dies(ev, conn):
        conn.recv()
        os._exit(3)

    monkeypatch.setattr(search_module, "_work_ahead", dies)
    monkeypatch.setattr(search_module, "spare_core", lambda: True)
    with pytest.raises(TpuBuildError, match=r"second process stopped \(exit code 3\).*\n.*TPUBUILD_PROCESSES=1"):
        search(
            apply_table(net.module, cali),
            net.weights,
            chip=BM1684X,
            cali=cali,
            asymmetric=False,
            samples=net.samples,
            config=SearchConfig(samples=3, chunks=8, max_lowerings=20),
            processes=2,
        )


def test_an_error_in_the_second_process_is_raised_here(net, monkeypatch):
    def broken(self, tpu_module, tpu_weights, i):
        if i % 2:
            raise TpuBuildError(f"sample {i} broke")
        return 1.0

    monkeypatch.setattr(search_module.Evaluator, "sample_score", broken)
    with pytest.raises(TpuBuildError, match="sample 1 broke"):
        search(
            apply_table(net.module, net.cali),
            net.weights,
            chip=BM1684X,
            cali=net.cali,
            asymmetric=False,
            samples=net.samples[:4],
            config=SearchConfig(samples=2),
            processes=2,
        )


def test_calibration_keeps_the_outputs_the_search_scores_against(net, tmp_path, monkeypatch):
    """The calibrate stage of a model with a search keeps each sample's TOP outputs under cali.mlir's key
    (top.inference.keep_outputs) for the search in the same process: they are TOP inference of cali.mlir bit for
    bit, and a search given them finds the table it finds computing its own. Without a search it keeps none."""
    from tpubuild.build import stages
    from tpubuild.calib.data import Samples
    from tpubuild.top import inference
    from tpubuild.top.inference import kept_outputs

    monkeypatch.setattr(inference, "_OUTPUTS", type(inference._OUTPUTS)())

    canonical = tmp_path / "canonical.mlir"
    mlir.save_module(net.module, canonical)
    net.weights.save(tmp_path / "canonical_weights.npz")
    files = []
    for i, sample in enumerate(net.samples[:4]):
        files.append(str(tmp_path / f"s{i}.npz"))
        np.savez(files[-1], **sample)
    inputs = [{"name": "x", "shape": list(SHAPE)}]
    stages.calibrate(
        "test",
        str(canonical),
        inputs,
        files,
        None,
        "max",
        None,
        str(tmp_path / "cali.mlir"),
        str(tmp_path / "cali_table"),
    )
    assert not inference._OUTPUTS
    stages.calibrate(
        "test",
        str(canonical),
        inputs,
        files,
        None,
        "max",
        None,
        str(tmp_path / "cali.mlir"),
        str(tmp_path / "cali_table"),
        searched=True,
    )
    cali_module = mlir.load_module(tmp_path / "cali.mlir")
    key = mlir.file_key(tmp_path / "cali.mlir")
    refs = {}
    for i, sample in enumerate(Samples.of(files, inputs)):
        kept = kept_outputs(key, sample)
        assert kept is not None
        top = run(cali_module, net.weights, sample, all_tensors=False)
        for name, array in zip(mlir.output_names(cali_module), kept, strict=True):
            assert array.dtype == top[name].dtype and array.tobytes() == top[name].tobytes()
        refs[i] = kept
    assert kept_outputs(key, {"x": np.zeros(SHAPE, np.float32)}) is None
    cali = net.wreck("r1")
    mine = search(
        apply_table(net.module, cali),
        net.weights,
        chip=BM1684X,
        cali=cali,
        asymmetric=False,
        samples=net.samples[:4],
        config=SearchConfig(target_cos=0.99),
    )
    given = search(
        apply_table(net.module, cali),
        net.weights,
        chip=BM1684X,
        cali=cali,
        asymmetric=False,
        samples=net.samples[:4],
        config=SearchConfig(target_cos=0.99),
        refs=refs,
    )
    assert mine.chosen and given.table == mine.table and given.score == mine.score


def test_kept_outputs_stay_within_their_budget(monkeypatch):
    from tpubuild.top import inference

    monkeypatch.setattr(inference, "_OUTPUTS", type(inference._OUTPUTS)())
    monkeypatch.setattr(inference, "_OUTPUTS_KEEP", 3 * 400)
    runs = [({"x": np.full(4, i, np.float32)}, [np.full(100, i, np.float32)]) for i in range(5)]
    inference.keep_outputs(b"m", runs)
    kept = [inference.kept_outputs(b"m", inputs) for inputs, _ in runs]
    assert kept[:2] == [None, None] and [k[0][0] for k in kept[2:]] == [2, 3, 4]  # the newest, 400 bytes each
    assert inference.kept_outputs(b"other", runs[4][0]) is None


class _Reaching:
    """An evaluator stand-in (search() builds it as Evaluator): a table holding t3 and t7 in float scores 0.993
    on every sample, as far as its float mode goes; any other 0.5. Every table scored is a lowering."""

    processes = 1

    def __init__(self, module, weights, *, samples, **_):
        self.lowerings, self.active, self.lowered, self.count = 0, list(range(len(samples))), {}, len(samples)

    def _score(self, table) -> float:
        return 0.993 if {"t3", "t7"} <= set(table) else 0.5

    def lower(self, table, counted=True):
        self.lowerings += counted
        self.lowered = dict(table)
        return None, None, None

    def pool_scores(self, tpu_module, tpu_weights) -> list[float]:
        return [self._score(self.lowered)] * self.count

    def keep(self, indices) -> None:
        self.active = list(indices)

    def score(self, table, order=None, stop_below=None, counted=True) -> dict[int, float]:
        self.lowerings += counted
        return {i: self._score(table) for i in (self.active if order is None else order)}

    def score_tables(self, tables) -> list[dict[int, float]]:
        return [self.score(t) for t in tables]


def test_a_target_beyond_the_float_mode_keeps_the_fewest_tensors_that_hold_the_floor(monkeypatch):
    """Everything in float reaches 0.993, short of the default target: the search returns t3 and t7 (what holds
    0.99), not all 12 tensors (the best score, every op in float)."""
    units = [search_module.Unit(f"t{i}", (f"t{i}",)) for i in range(12)]
    monkeypatch.setattr(search_module, "Evaluator", _Reaching)
    monkeypatch.setattr(search_module, "units_of", lambda lw, user: units)
    monkeypatch.setattr(search_module, "macs_share", lambda module, names: 0.0)  # no module here
    result = search(
        None, None, chip=BM1684X, cali={}, asymmetric=False, samples=[{}, {}], config=SearchConfig(max_lowerings=60)
    )
    assert not result.reached and result.score == 0.993
    assert set(result.table) == {"t3", "t7"}
    assert "# TARGET NOT REACHED: the fewest tensors found that hold 0.99, below 0.995" in format_result(result)


def test_a_target_beyond_the_float_mode_itself_says_so_and_the_hint_does_not_ask_for_more_lowerings(
    net, tmp_path, monkeypatch
):
    """Past 1.0 no table can reach the target: once the greedy has every tensor in float, the table records that
    score, and a failing target's hint says the model needs more precision than the float mode instead of asking for
    more lowerings, which it still does when the search stopped for want of them. The floor is set out of reach
    too, as when the float mode itself is far from float32 (table_cls 1.0.0 on cv183x: 0.93 all in BF16)."""
    from tpubuild.build.stages import int8_failure_hint

    monkeypatch.setattr(search_module, "FLOOR_COS", 1.5)
    cali = net.wreck("r1")
    target = tmp_path / "bm1684x-INT8"
    target.mkdir()
    table = target / "qtable.txt"

    beyond = run_search(net, cali, target_cos=1.0 + 1e-9, samples=3, chunks=2, max_lowerings=40)
    assert not beyond.reached and beyond.all_float is not None and 0.999 < beyond.all_float < 1.0 + 1e-9
    table.write_text(format_result(beyond))
    assert f"# {search_module.ALL_FLOAT_LINE} F16: {beyond.all_float:.6f}, below the target too" in table.read_text()
    hint = int8_failure_hint("bm1684x-INT8", str(table))
    assert f"with every op in F16, the chip's float mode, the model reaches only cos {beyond.all_float:.6f}" in hint
    assert "more precision than F16" in hint and "max_lowerings" not in hint

    short = run_search(net, cali, target_cos=1.0 + 1e-9, samples=3, chunks=2, max_lowerings=2)
    assert not short.reached and short.all_float is None
    table.write_text(format_result(short))
    assert search_module.ALL_FLOAT_LINE not in table.read_text()
    assert "max_lowerings" in int8_failure_hint("bm1684x-INT8", str(table))
