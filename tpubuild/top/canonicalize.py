"""origin.mlir -> canonical.mlir: the TOP passes that run before calibration and lowering.

Each pass is a frozen-dataclass ``ModulePass`` walking its patterns greedily
(tpubuild/top/patterns/); passes whose patterns read or write weight arrays
hold the weight store. The pipeline is a plain list, run in order:

1. fold constants (ops whose operands are all weights become weights),
2. drop dead ops (a dead user would otherwise block the "single user" rules),
3. remove no-ops (Identity/Dropout, identity Reshape/Permute, one-input Concat,
   a Concat's empty inputs), merge Reshape/Permute chains, and take a Split or
   Slice of what a Concat joined from the Concat's inputs (a YOLOv8 head's box
   and class parts),
4. drop the ops that left dead,
5. recognise a logistic written 1 / (1 + exp(z)) as Sigmoid, and decomposed SiLU/Swish,
   GELU, HardSwish, Mish and LayerNorm (with its scale and bias) as single ops, dropping x*1
   and x+0 on the way,
6. fold an explicit Pad into the Conv / pool reading it,
7. fold BatchNorm into the Conv before it (else rewrite it as Mul + Add),
8. fold Mul/Add/Sub by per-channel constants into Conv/MatMul, and a scalar
   Mul/Div into the Softmax after it (beta), also through the MatMul of
   attention scores (Softmax((q * s) @ k)); what no producer takes, a Conv or
   MatMul reading it may (W * (a*x + b) = (W*a) * x + W*b),
9. fuse ReLU / Clip(0, N) into the op that feeds it,
10. drop the ops the folds left dead.

Folding before fusion matters: Conv -> BatchNorm -> Relu needs the BatchNorm
gone before the Relu can reach the Conv. Recognition comes before fusion too:
HardSwish's Clip(x + 3, 0, 6) must still be a Clip, not a ReLU-6 fused into the
Add. Every rewritten op keeps the tensor name of the last op it replaces, so
comparisons by name still line up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import GreedyRewritePatternApplier, PatternRewriteWalker, RewritePattern

from tpubuild.ir import mlir
from tpubuild.ir.weights import WeightStore
from tpubuild.top.patterns import cleanup, fold, fold_input, fuse, layout, pad, recognize


def _walk(module: ModuleOp, patterns: list[RewritePattern], *, reverse: bool = False) -> None:
    applier = GreedyRewritePatternApplier(patterns, dce_enabled=False)
    PatternRewriteWalker(applier, walk_reverse=reverse).rewrite_module(module)


@dataclass(frozen=True)
class FoldConstantsPass(ModulePass):
    """Ops computable from weights alone are computed now and become weights."""

    name = "top-fold-constants"
    weights: WeightStore = field(default_factory=WeightStore)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(op, [cleanup.FoldConstantOp(self.weights)])


@dataclass(frozen=True)
class RemoveNoOpsPass(ModulePass):
    """Identity-like ops removed, Reshape/Permute chains merged, Splits of Concats taken from their inputs."""

    name = "top-remove-noops"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(
            op,
            [
                cleanup.RemoveIdentity(),
                layout.RemoveNoOpReshape(),
                layout.MergeReshapes(),
                layout.RemoveNoOpPermute(),
                layout.MergePermutes(),
                layout.PermuteAsReshape(),
                layout.RemoveSingleConcat(),
                layout.DropEmptyConcatInputs(),
                layout.SplitConcatParts(),
                layout.SliceConcatPart(),
            ],
        )


@dataclass(frozen=True)
class RemoveDeadOpsPass(ModulePass):
    """Ops whose results nothing uses are erased (graph inputs stay)."""

    name = "top-remove-dead"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        # users before producers, so a whole dead chain goes in one walk
        _walk(op, [cleanup.RemoveDeadOp()], reverse=True)


@dataclass(frozen=True)
class RecognizePass(ModulePass):
    """A written-out logistic, decomposed SiLU, GELU, HardSwish, Mish, means and LayerNorm become single ops;
    x*1, x/1, x+0, x-0 go."""

    name = "top-recognize"
    weights: WeightStore = field(default_factory=WeightStore)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        w = self.weights
        _walk(
            op,
            [
                recognize.RemoveNeutralArith(w),
                recognize.RecognizeSigmoid(w),
                recognize.RecognizeActivation(w),
                recognize.RecognizeMean(w),
                recognize.RecognizeLayerNorm(w),
                recognize.RecognizeLayerNormAffine(w),
            ],
        )


@dataclass(frozen=True)
class FoldPadPass(ModulePass):
    """A constant Pad of spatial dims folded into the Conv / MaxPool / AvgPool reading it."""

    name = "top-fold-pad"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(op, [pad.FoldPadIntoConv(), pad.FoldPadIntoMaxPool(), pad.FoldPadIntoAvgPool()])


@dataclass(frozen=True)
class FoldBatchNormPass(ModulePass):
    """BatchNorm folded into the preceding Conv; one with nothing to fold into becomes Mul + Add."""

    name = "top-fold-batchnorm"
    weights: WeightStore = field(default_factory=WeightStore)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        # order matters: the fold is tried first, the decomposition is the fallback
        _walk(op, [fold.FoldBatchNorm(self.weights), fold.DecomposeBatchNorm(self.weights)])


@dataclass(frozen=True)
class FoldScaleBiasPass(ModulePass):
    """Mul/Add/Sub by per-channel constants folded into the Conv/MatMul weights and bias before
    (or else after) them, and a scalar scale into the Softmax after it."""

    name = "top-fold-scale-bias"
    weights: WeightStore = field(default_factory=WeightStore)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(
            op,
            [
                fold.FoldMulIntoProducer(self.weights),
                fold.FoldAddIntoProducer(self.weights),
                fold.FoldSubIntoProducer(self.weights),
                fold.FoldScaleIntoSoftmax(self.weights),
                fold.FoldQueryScaleIntoSoftmax(self.weights),
                fold_input.FoldInputAffineIntoConv(self.weights),
                fold_input.FoldInputAffineIntoMatMul(self.weights),
            ],
        )


@dataclass(frozen=True)
class FuseActivationPass(ModulePass):
    """ReLU and Clip(0, N) fused into the op producing their input."""

    name = "top-fuse-activation"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        _walk(op, [fuse.FuseRelu(), fuse.FuseClipAsRelu()])


def get_all_passes() -> dict[str, type[ModulePass]]:
    """Pass name -> class, for tools that pick passes by name."""
    return {
        cls.name: cls
        for cls in (
            FoldConstantsPass,
            RemoveNoOpsPass,
            RemoveDeadOpsPass,
            RecognizePass,
            FoldPadPass,
            FoldBatchNormPass,
            FoldScaleBiasPass,
            FuseActivationPass,
        )
    }


def pipeline(weights: WeightStore) -> list[ModulePass]:
    """The canonicalize passes in order; the weight-touching ones share ``weights``."""
    return [
        FoldConstantsPass(weights),
        RemoveDeadOpsPass(),
        RemoveNoOpsPass(),
        RemoveDeadOpsPass(),
        RecognizePass(weights),
        FoldPadPass(),
        FoldBatchNormPass(weights),
        FoldScaleBiasPass(weights),
        FuseActivationPass(),
        RemoveDeadOpsPass(),
    ]


def run_passes(module: ModuleOp, passes: list[ModulePass]) -> None:
    ctx = mlir.context()
    for p in passes:
        p.apply(ctx, module)
    module.verify()


def canonicalize(module: ModuleOp, weights: WeightStore, weight_file: str) -> tuple[ModuleOp, WeightStore]:
    """The canonical module (a new one; ``module`` is left alone) and exactly the weights it uses.

    Weights that passes create or change get fresh names; ``weights`` is not modified.
    """
    module = module.clone()
    store = WeightStore({name: weights[name] for name in weights})
    run_passes(module, pipeline(store))
    mlir.set_module_attrs(module, weight_file=weight_file)
    return module, store.keep_only(mlir.weight_names(module))
