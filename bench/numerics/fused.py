"""Quantisers at memory speed: each eager quantiser (a chain of elementwise passes over the tensor) also runs as one
fused pass compiled by inductor, bit for bit the same, where that pays.

`@fused(from_elements=n)` wraps a quantiser `fn(x, ...)`. A call runs fn's compiled graph (a `Specialisation`:
traced by make_fx, compiled by inductor, called without dynamo's guards) when every one of these
holds, and `fn` itself otherwise (`quantiser.eager`, the reference, runs fn with every quantiser it calls eager):
- x has at least n elements (n may depend on the call's arguments). A compiled call costs a fixed 6-13 us, and a
  new layout one compile (0.1-0.9 s). Measured on a 2-core Intel Xeon (`make bench`'s quantise_call_us rows,
  docs/performance.md): the block quantisers and the arithmetic element roundings (FP8 E4M3, TF32, FP6, FP4) cost
  20-120 us eagerly at any size, so they compile at every size; a format torch casts to natively (FP16, BF16,
  E5M2: two eager passes) saves 2-3 us a call below 4,096 elements, too little to repay a compile, so only from
  there (compiled, E5M2 is rounded in arithmetic, not cast: bench/numerics/formats.py says why);
- x is on the CPU (FUSED_DEVICES), and no graph is being traced or compiled already (a compiled model, or a fused
  quantiser calling another, takes the eager body into its own graph). On CUDA the quantisers run eagerly: on an
  H200 (2026-11-30, `pytest -m cuda`) every quantiser compiled into Triton gave its eager bits and LeNet FP8 fused
  logged the eager losses, but BERT-tiny's NVFP4 recipe fused did not, for a reason not yet found
  (docs/performance.md; `quantiser.fused` compiles for CUDA, with eager CUDA's division and subnormals:
  `_eager_numerics`);
- the call draws no random numbers, or its quantiser makes its draws itself (`fused(draws=...)`: every block
  quantiser that rounds stochastically, MX, NVFP4 by either scale rule, its 16 x 16 tiles, FP8 rowwise and 1 x 128
  tiles). A compiled graph would draw from inductor's own generator, not the eager one's stream, so such a
  quantiser draws eagerly, from the call's generator, what its eager body would draw, and its graph takes them
  (`draw`). Other calls that would draw (a `generator` with no stochastic rounding to give it, a quantiser that
  declares no draws) run eagerly; `_round_up_below`, given its draws, is fused;
- no gradient is being recorded through x (the quantisers run inside autograd Functions' forward passes);
- the environment does not say `PRECISION_BENCH_FUSED=0` (the switch; on by default). Records say which ran
  (`env.fused_quantisers`); the test suite runs the eager reference unless a test switches it on.
A layout's graph is made once what its eager calls would have saved fused has cost what making it is expected to
cost, and kept if it proves faster, or with `PRECISION_BENCH_FUSED_COMPILE=at-once` made and kept on its first call
(`Specialisation` says why). A block quantiser's graph on ONE_PASS_FROM values or more is one loop over blocks
(`in_one_pass` says why), but where the quantiser declares `chunk_rows` (MX), its values from CHUNKED_FROM are
quantised in chunks of rows instead, each chunk read again from the caches (`_in_chunks`).
A BF16 or FP16 x enters the compiled graph as FP32 and its result leaves in x's dtype: inductor's CPU code for a
16-bit tensor cast to FP8 and back ran 2x slower than torch's eager casts.

Why not `torch.compile`: its guards and dispatch cost about 20 us a call here (60-120 us inside an emulated step,
profiled), as much as the passes saved on LeNet's and BERT-tiny's tensors, and made emulated steps slower. A
Specialisation keys its graphs on what a graph assumes (shape, strides, offset, dtype, device) and looks the key up
itself; a caller that rounds one layout step after step (an emulated GEMM's rounding site) binds the quantiser's
other arguments (`quantiser.bind`, a `Bound`), which calls that layout's graph again without the lookups. A whole
pass of an emulated GEMM (its roundings, torch's op, the casts: bench/numerics/emulation.py's _EmulatedOp) runs the
same way, as one Specialisation per pass (`run_specialised`), its last layout's graph kept at hand (`Passes`).

Exactness. Inductor may fuse a cast to a 16-bit type and back into nothing: `x.to(bf16).to(fp32)`, the rounding
itself, comes back unrounded unless `emulate_precision_casts` is set, which it is here. A multiply and an add
contracted into an FMA would round once where the eager ops round twice, and unsafe math reorders and folds the
roundings' arithmetic: inductor's C++ code is compiled without either (`INDUCTOR_OPTIONS` holds its defaults against
an environment that changes them), and torch 2.13's Triton code without contraction while `emulate_precision_casts`
is set. The quantisers' roundings are chains of steps exact as written (adds of a power-of-two magic number, integer
bit operations, multiplies by powers of two, compares: unsafe math would fold `x + m - m` into `x`; in these graphs
an element rounding is Veltkamp's split, x(2^k + 1) - (x(2^k + 1) - x), which contraction would make one rounding
and no split: bench/numerics/formats.py); their inexact steps (a product such as NVFP4's x * (1 / s), the
divisions) inductor computes as written. tests/test_fused.py holds
every quantiser to its eager self on every conformance family, format and overflow policy, and an emulated training
run fused to the eager run's losses. An emulated op's pass also computes what is not exact: its GEMMs and
convolutions, which its graph calls as torch's own kernels on the eager layouts, and a Linear's bias gradient, a sum
over rows, which inductor would generate adding them in another order (different bits in about half its elements
over 32 rows of FP32 values: a fresh clone's default sweep drifted from the eager records after 580 steps), so it
too is torch's (`emulation.summed_rows`, an extern call in the graph).
The one departure it finds is a NaN's payload (FP32's quiet NaN in, 0x7fffffff out where eager returns 0x7fc00000):
still NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import time
from typing import Callable

import torch

# emulate_precision_casts: keep x.to(bf16/fp16).to(fp32) a rounding when fused. realize_opcount_threshold: store a
# value that takes more than 10 operations, and that more than one consumer reads, where inductor's CPU code would
# recompute it for every element that reads it (50 by default): a block's scale and factor, computed once per block
# and not once per element (docs/performance.md: a call 2.3-7.5x faster along the first dimension, where the loop
# over a block's elements is outside the loop over columns). At 8 the element rounding's own steps (the splitting's
# c and c - x on a block's scaled values) were stored too, each a tensor of x's size: MX's call 17x
# slower (1.7 ms against 0.10 on 768 x 512); at 16 MX's factor 2^-e is recomputed per element again (3x slower
# along dim 0). tests/test_fused.py holds what a graph stores
# layout_optimization off: an emulated op's graph (bench/numerics/emulation.py) calls torch's convolution on the
# layouts its eager pass gives it, not channels-last ones, whose kernels may sum in another order
# the C++ compiler's unsafe math and FMA contraction off, whatever the environment says (inductor's defaults, which
# TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG and ..._FLOATING_POINT_CONTRACT_FLAG change): unsafe math changed
# the bits of the element roundings in arithmetic, TE's NVFP4 and the 1 x 128 tiles (tests/test_fused.py);
# contraction ("fast") is held off for the element roundings' split (formats._round_by_splitting)
INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "realize_opcount_threshold": 10, "layout_optimization": False,
                    "cpp.enable_floating_point_contract_flag": "off", "cpp.enable_unsafe_math_opt_flag": False}
SWITCH = "PRECISION_BENCH_FUSED"  # =0: every quantiser eager; otherwise (the default) fused where it pays
# when a layout's graph is made (`Specialisation`): once what its eager calls would have saved has cost what making it
# is expected to cost (the default), or on its first call (a long run's steady state from its first step: `make
# bench`, the tests)
COMPILE_WHEN = "PRECISION_BENCH_FUSED_COMPILE"
WHEN_PAID, AT_ONCE = "when-paid", "at-once"
COMPILE_WHEN_CHOICES = (WHEN_PAID, AT_ONCE)
# What making graphs costs, before a process has timed its own: its first graph 2.6-2.8 s (LeNet FP8's, BERT-tiny
# NVFP4's, from inductor's disk cache on this 2-core AMD EPYC; the slowest 8.1 s on an empty cache), inductor warming
# up once for every later graph, and most later ones 0.05-0.4 s (median 0.15; 0.67 on an empty cache): WARM_UP_S, and
# GRAPH_S until a process has made a second graph, from when it expects the mean of its own after the first
WARM_UP_S = 2.5
GRAPH_S = 0.5
# the share of an eager call that its graph is expected to save, before a trial has measured one: the eager seconds
# counted are whole calls, an emulated op's GEMM or convolution in them, which its graph runs as long (LeNet FP8's
# 800-step cell: 2.9 s of eager calls, 0.8 s saved fused); after, the mean of the shares measured on trial
SAVING_SHARE = 0.5
# a graph made when its layout had paid for it runs this many calls on trial: kept where its fastest beats the
# layout's fastest eager call, else the layout runs eagerly again (`Specialisation`)
TRIAL_CALLS = 3
ARITHMETIC_FROM = 1  # block and tile quantisers, and element roundings done in arithmetic: every size
CAST_FROM = 1 << 12  # element roundings that are torch's own cast (two eager passes): from 4,096
SIXTEEN_BIT = (torch.bfloat16, torch.float16)  # compiled on their FP32 widening (the module docstring says why)
# where runs call the compiled quantisers: not CUDA, where on an H200 (2026-11-30, `pytest -m cuda`) a BERT-tiny
# NVFP4 recipe run fused departed from the eager run's losses though each fused call gave its eager bits
# (docs/performance.md; the quantisers and LeNet FP8's run passed there)
FUSED_DEVICES = ("cpu",)
ONE_PASS_FROM = 1 << 22  # values (16 MB of FP32): from here a block quantiser's graph, unchunked, is one loop
CHUNKED_FROM = ONE_PASS_FROM  # values: from here a quantiser declaring `chunk_rows` quantises its values in chunks
CHUNK_VALUES = 1 << 20  # values of x a chunk holds at least (4 MB of FP32: read again from the caches, not memory)
LAYOUTS_PER_SPECIALISATION = 32  # graphs per quantiser and arguments; past it, a new shape runs eagerly


_tracing = False  # a graph is being traced: every quantiser called inside it runs its eager body
_in_reference = False  # a `quantiser.eager` call is running: every quantiser called inside it runs its eager body
FELL_BACK: list[str] = []  # the specialisations that failed to compile in this process (they run eagerly)
_compile_s = 0.0  # seconds this process has spent making graphs (traced and compiled, or failing to)
_graphs_made = 0  # graphs this process has made (or failed to make) in those seconds
_first_graph_s = 0.0  # of which its first graph's, inductor's warm-up in it
_eager_s = 0.0  # seconds of eager calls on layouts not yet compiled, every quantiser's, before the first graph
_shares_measured: list[float] = []  # per graph tried: the share of its layout's fastest eager call that it saved
_clock = time.perf_counter  # what times a layout's eager calls (a test's own clock in its place)
logger = logging.getLogger(__name__)


def in_graph() -> bool:
    """Whether the code running now is being traced into a graph: a fused quantiser's, or a compiled model's."""
    return _tracing or torch.compiler.is_compiling()


def in_fused_graph() -> bool:
    """Whether the code running now is being traced into a fused graph of ours, compiled with INDUCTOR_OPTIONS (a
    cast there and back kept a rounding), not into a compiled model's, whose inductor runs on its defaults."""
    return _tracing and not torch.compiler.is_compiling()


def in_one_pass(amax: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A block quantiser's per-block amax (non-negative, or NaN), unchanged, written so that in a fused graph of x of
    ONE_PASS_FROM values or more inductor's CPU code runs the whole quantiser as one loop over blocks: a block's amax,
    then its scale and factor, then its elements, which it reads again from L1. Otherwise inductor vectorises the
    per-block step across blocks (16 at a time with AVX-512), a loop that steps unlike the two around it, so it runs
    three loops over the tensor and reads x twice from memory (docs/performance.md: MXFP8 past the caches at 0.45 of
    clone's throughput). The term added (0, or 1 to a NaN) is int16, a type inductor's CPU code does not vectorise
    (VECTORIZABLE_DTYPES in torch/_inductor/codegen/cpp.py): the step runs one block at a time, and inductor's
    outer-loop fusion then joins the three loops. In the caches the vectorised step is the faster, hence the size
    (measured: docs/performance.md); tests/test_fused.py holds both forms. Eagerly, off the CPU (the term works on
    inductor's CPU code alone), and in a compiled model's graph: amax itself."""
    if x.numel() < ONE_PASS_FROM or x.device.type != "cpu" or not in_fused_graph():
        return amax
    return amax + amax.isnan().to(torch.int16)


@contextlib.contextmanager
def _random_streams_kept(device: torch.device):
    """Making a graph draws nothing from the run's random streams (the CPU's and x's CUDA device's), whatever
    tracing, compiling or tuning it draws: a fused run's dropout masks and stochastic draws stay the eager run's.
    Dynamo restores them around its compiles as this does (torch/_dynamo/convert_frame.py); a Specialisation
    bypasses dynamo, and inductor restores them around its code generation alone."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def compile_seconds() -> float:
    """Seconds this process has spent making fused graphs so far. A new layout's graph is made on its first call,
    inside a training step or an evaluation (0.1-0.9 s each, a minute for a cell's first steps on an empty inductor
    cache): the training loop times such steps apart, as it does torch.compile's (bench/running/train.py)."""
    return _compile_s


def enabled() -> bool:
    """Whether fused quantisers may run here (unless `PRECISION_BENCH_FUSED=0`, or inside an eager reference)."""
    return not _in_reference and os.environ.get(SWITCH, "1") != "0"


def compile_when() -> str:
    """When a layout's graph is made: `PRECISION_BENCH_FUSED_COMPILE`, WHEN_PAID unless it says AT_ONCE (a run
    refuses any other value before it trains: bench/running/config.py)."""
    return os.environ.get(COMPILE_WHEN, WHEN_PAID)


def expected_graph_seconds() -> float:
    """What making the next graph is expected to cost, inductor's warm-up aside: the mean of the graphs this process
    has made after its first (whose time holds the warm-up), GRAPH_S before it has made two."""
    return (_compile_s - _first_graph_s) / (_graphs_made - 1) if _graphs_made > 1 else GRAPH_S


def expected_saving_share() -> float:
    """The share of an eager call that its graph is expected to save: the mean of those measured on trial in this
    process, SAVING_SHARE before any."""
    return sum(_shares_measured) / len(_shares_measured) if _shares_measured else SAVING_SHARE


def _paid_for(eager_s: float) -> bool:
    """Whether a layout whose eager calls have taken `eager_s` has paid for its graph: what they would have saved
    fused (`expected_saving_share`) is what the graph is expected to cost to make, and before a process's first
    graph, what every layout's eager calls together would have saved is inductor's one-off warm-up as well, which
    serves every graph."""
    share = expected_saving_share()
    return eager_s * share >= expected_graph_seconds() and (_graphs_made > 0 or _eager_s * share >= WARM_UP_S)


def _wholly_eager(eager: Callable) -> Callable:
    """`quantiser.eager`: the eager body with every quantiser it calls eager too (a block quantiser's element
    rounding, a stochastic rounding's `_round_up_below`), so that a fused graph is held to a reference with no
    compiled code in it. The body a call falls back to keeps its inner quantisers' own choice."""
    @functools.wraps(eager)
    def reference(*args, **kwargs):
        global _in_reference
        _in_reference, outer = True, _in_reference
        try:
            return eager(*args, **kwargs)
        finally:
            _in_reference = outer
    return reference


def _picking(fn: Callable, pick: str | None) -> Callable:
    """fn, returning its result's field `pick` alone where pick is given (a block quantiser's `values`): what its
    eager call, its graph and a call past its layouts all return."""
    if pick is None:
        return fn
    return functools.wraps(fn)(lambda x, *args, **kwargs: getattr(fn(x, *args, **kwargs), pick))


def _runs_eagerly(x: torch.Tensor, least: int) -> bool:
    """Whether a call on x runs its quantiser's eager body whatever its other arguments (the module docstring's
    list): switched off (asked first: off, a call costs one lookup before the eager body), fewer than `least`
    elements, off FUSED_DEVICES, a graph being traced, or a gradient being recorded through x. A `Bound`'s call on
    the layout it kept asks only those that can change from call to call: a new one goes there too."""
    return (not enabled() or x.numel() < least or x.device.type not in FUSED_DEVICES or in_graph()
            or (x.requires_grad and torch.is_grad_enabled()))


def _static_key(args: tuple, kwargs: dict) -> tuple:
    """The call's non-tensor arguments (format, policy, dim, ...) and where its tensors sit, which a compiled graph
    is specialised on (a key only where they can all be hashed)."""
    key = tuple(a if not isinstance(a, torch.Tensor) else _TENSOR for a in args)
    if kwargs:
        key += tuple((k, v if not isinstance(v, torch.Tensor) else _TENSOR) for k, v in sorted(kwargs.items()))
    return key


class _TensorSlot:
    """Where a tensor argument sits in a static key (its value is an input of the graph, not part of the key)."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()
_UNSEEN = object()  # a static key not met before


def _layout(tensors: list[torch.Tensor]) -> tuple:
    """What a graph compiled for these tensors assumes of each: shape, strides, offset, dtype, device (a list, not a
    generator, and no call a tensor: a call's cost, which every call pays)."""
    return tuple([(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) for t in tensors])


class Specialisation:
    """One quantiser with its non-tensor arguments fixed, compiled per layout of its tensor arguments: each graph
    traced by make_fx and compiled as `torch._inductor.compile` compiles it (AOTAutograd's passes, then inductor's),
    and inductor's generated code then called directly, without AOTAutograd's runtime wrappers (about 5 us a call)
    or the CompiledFxGraph around it (about 1). Where those wrappers do something (`_called_directly`), the graph
    keeps them. A graph compiled this way has no guards to check: the layout is the key that a call is checked
    against, in Python. A small call costs about 7 us here (a bound one 3.4: `Bound`) where `torch.compile`'s guards
    and dispatch cost about 20 (docs/performance.md). Past
    LAYOUTS_PER_SPECIALISATION layouts (shapes that keep changing), new ones run eagerly.

    When a layout's graph is made (`compile_when`): by default, once what the layout's eager calls would have saved
    fused has cost what making a graph is expected to cost (`expected_graph_seconds`), as one rents skis until the
    rent would have bought them, and inductor's one-off warm-up, which serves every graph, once every layout's eager
    calls together would have saved it (`_paid_for`). A graph that pays for itself then costs at most twice what
    compiling it at once would have, and one that never would at most three times what running eagerly costs (its
    cost and saving as expected, its calls alike), where compiling every layout on its first call (AT_ONCE) made a
    default LeNet FP8 cell 2.8x slower than eager (0.8 s of steps saved, 14 s of compiling) and `make sweep` 2.2x
    (docs/performance.md). What a graph saves is known only once it is made, and it can be nothing (Transformer
    Engine's stochastic NVFP4 on a char-LM's gradients: 4-6 ms a call fused against 2-4 eagerly): a graph made this
    way runs TRIAL_CALLS calls on trial, is kept only where it was the faster, and what it saved
    (`expected_saving_share`) prices the next."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, pick: str | None = None,
                 chunk_rows: Callable[..., int | None] | None = None):
        """args, kwargs: a call's, whose static key this is: where its tensor arguments sit is part of that key.
        pick: the one field of fn's dataclass result that the graph returns (None: all of them).
        chunk_rows: `fused`'s, for a graph returning one tensor of x's shape (`_in_chunks`)."""
        self.fn = _picking(fn, pick)  # the other fields are never written: inductor drops what no output needs
        self.chunk_rows = chunk_rows
        self.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.names = [k for k in sorted(kwargs) if isinstance(kwargs[k], torch.Tensor)]
        self.graphs: dict[tuple, Callable] = {}  # per layout: its graph, which every call runs
        self.eager_s: dict[tuple, float] = {}  # per layout not yet compiled: seconds its eager calls have taken...
        self.fastest_eager: dict[tuple, float] = {}  # ...and its fastest one's
        self.trials: dict[tuple, _Trial] = {}  # per layout: its graph on trial
        self.no_faster: set[tuple] = set()  # layouts whose graph was no faster than their eager calls: eager

    def made(self) -> int:
        """Graphs made for this quantiser: kept, on trial, or dropped."""
        return len(self.graphs) + len(self.trials) + len(self.no_faster)

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        tensors = [x]  # (map, not a generator: a Python frame less a call, which counts in a step's cold code)
        if self.slots:
            tensors += map(args.__getitem__, self.slots)
        if self.names:
            tensors += map(kwargs.__getitem__, self.names)
        layout = _layout(tensors)
        graph = self.graphs.get(layout)
        if graph is not None:
            return graph(tensors)
        if layout in self.trials:
            return self._on_trial(layout, tensors)
        if layout in self.no_faster or self.made() >= LAYOUTS_PER_SPECIALISATION:
            return self.fn(x, *args, **kwargs)
        at_once = compile_when() == AT_ONCE
        if not at_once and not _paid_for(self.eager_s.get(layout, 0.0)):
            return self._eagerly(layout, x, args, kwargs)
        self.eager_s.pop(layout, None)
        with _random_streams_kept(x.device):  # its first call too, where Triton tunes a kernel
            graph = self._compile(tensors, args, kwargs)
            if at_once:
                self.graphs[layout] = graph
                return graph(tensors)
            self.trials[layout] = _Trial(graph, self.fastest_eager.pop(layout, 0.0))
            return self._on_trial(layout, tensors)

    def _eagerly(self, layout: tuple, x: torch.Tensor, args: tuple, kwargs: dict):
        """fn's eager call on a layout not yet compiled, its seconds (less those of any graph made inside it: an
        inner quantiser's) added to the layout's and, before the first graph, to every layout's (`_paid_for`)."""
        global _eager_s
        made_s, start = _compile_s, _clock()
        result = self.fn(x, *args, **kwargs)
        seconds = (_clock() - start) - (_compile_s - made_s)
        self.eager_s[layout] = self.eager_s.get(layout, 0.0) + seconds
        self.fastest_eager[layout] = min(seconds, self.fastest_eager.get(layout, seconds))
        if not _graphs_made:
            _eager_s += seconds
        return result

    def _on_trial(self, layout: tuple, tensors: list[torch.Tensor]):
        """The layout's graph on trial, timed: after TRIAL_CALLS calls, kept where its fastest call beat the fastest
        eager one, else dropped (the layout runs eagerly from then on)."""
        trial = self.trials[layout]
        start = _clock()
        result = trial.graph(tensors)
        trial.fastest = min(trial.fastest, _clock() - start)
        trial.calls += 1
        if trial.calls >= TRIAL_CALLS:
            del self.trials[layout]
            if trial.fastest_eager > 0:
                _shares_measured.append(max(0.0, 1.0 - trial.fastest / trial.fastest_eager))
            if trial.fastest < trial.fastest_eager:
                self.graphs[layout] = trial.graph
            else:
                self.no_faster.add(layout)
        return result

    def _compile(self, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Callable:
        """`_compiled_graph`, its seconds and itself counted (`compile_seconds`, `expected_graph_seconds`)."""
        global _compile_s, _graphs_made, _first_graph_s
        first = not _graphs_made
        if first:  # a run that seems to hang for a minute says why
            logger.info("compiling the fused quantisers for this run's shapes (inductor: a minute or more on 2 cores "
                        "the first time on a machine, seconds once its cache holds them; PRECISION_BENCH_FUSED=0 "
                        "runs them eagerly)")
        start = time.perf_counter()
        try:
            return self._compiled_graph(tensors, args, kwargs)
        finally:
            seconds = time.perf_counter() - start
            _compile_s += seconds
            _first_graph_s = seconds if first else _first_graph_s
            _graphs_made += 1

    def _compiled_graph(self, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Callable:
        """The graph of fn on these tensors (the other arguments as constants), compiled; a callable of the list of
        tensors returning what fn returns (a tensor, or a dataclass of tensors such as blocks.Blocked)."""
        cuts = _in_chunks(self.chunk_rows, tensors, args, kwargs)
        if cuts is not None:
            return self._chunked_graph(tensors, args, kwargs, cuts)
        made: dict = {}
        slots, names = self.slots, self.names

        def traced(*inputs):
            x, rest, named = inputs[0], list(args), dict(kwargs)
            for i, t in zip(slots, inputs[1:]):
                rest[i] = t
            for k, t in zip(names, inputs[1 + len(slots):]):
                named[k] = t
            result = self.fn(x, *rest, **named)
            if isinstance(result, torch.Tensor):
                made["rebuild"], made["outputs"] = _ONE_TENSOR, 1
                return (result,)
            is_tuple = isinstance(result, tuple)
            values = list(result) if is_tuple else [getattr(result, f.name) for f in dataclasses.fields(result)]
            written = [v is not None for v in values]
            made["rebuild"], made["outputs"] = _rebuild(type(result), is_tuple, written), sum(written)
            return tuple(v for v in values if v is not None)

        call = _inductor_graph(traced, list(tensors), lambda: made["outputs"])
        return _returning(made["rebuild"], call)

    def _chunked_graph(self, tensors: list[torch.Tensor], args: tuple, kwargs: dict, cuts: list[int | None]
                       ) -> Callable:
        """The graph of fn on x's chunks of rows (`_in_chunks`' cuts: its last chunk shorter where they do not divide
        x), each chunk an input of its own with its draws' chunk, their results concatenated: inductor's code for
        one chunk is the same as for the next (compiled once), and runs chunk after chunk, each chunk's loops over
        it reading its values again from the caches. A call cuts its tensors alike (views) and hands the graph
        those, its scalars to every chunk."""
        def pieces(inputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
            return [list(t.split(rows)) if rows else [t] for t, rows in zip(inputs, cuts)]

        example = pieces(tensors)
        sizes, count = [len(cut) for cut in example], len(example[0])
        slots, names = self.slots, self.names

        def traced(*flat):
            per_tensor, at = [], 0
            for size in sizes:  # each tensor's chunks, or itself for every chunk
                per_tensor.append(flat[at:at + size] if size > 1 else flat[at:at + 1] * count)
                at += size
            results = []
            for chunk in range(count):
                rest, named = list(args), dict(kwargs)
                for i, t in zip(slots, per_tensor[1:]):
                    rest[i] = t[chunk]
                for k, t in zip(names, per_tensor[1 + len(slots):]):
                    named[k] = t[chunk]
                results.append(self.fn(per_tensor[0][chunk], *rest, **named))
            return (torch.cat(results),)

        call = _inductor_graph(traced, [piece for cut in example for piece in cut], lambda: 1, _concatenated_unviewed)
        return lambda inputs: call([piece for cut in pieces(inputs) for piece in cut])[0]


def _inductor_graph(traced: Callable, example: list[torch.Tensor], outputs: Callable[[], int],
                    rewrite: Callable | None = None) -> Callable:
    """`traced` (a function of tensors returning a tuple of them) as a graph traced by make_fx on `example` (the
    quantisers it calls traced into it, eagerly), rewritten in place by `rewrite` where given, and compiled as
    `torch._inductor.compile` compiles it; a callable of a list of tensors returning the graph's outputs: inductor's
    generated code itself where it gives all `outputs()` of them (known once traced), AOTAutograd's wrapped graph
    otherwise (`_called_directly`)."""
    # here, not at import: a refused command imports nothing heavy
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch.fx.experimental.proxy_tensor import make_fx

    global _tracing
    with torch.no_grad():
        _tracing, outer = True, _tracing
        try:  # the quantisers fn calls (quantise_value inside mx_quantise) are traced into its graph, eagerly
            graph = make_fx(traced)(*example)
        finally:
            _tracing = outer
        if rewrite is not None:
            rewrite(graph)
        inner = []  # inductor's compiled graph, kept as AOTAutograd's pipeline hands it on

        def keep(*args, **kwargs):
            inner.append(compile_fx_inner(*args, **kwargs))
            return inner[-1]

        wrapped = compile_fx(graph, example, inner_compile=keep,
                             config_patches={**INDUCTOR_OPTIONS, **_eager_numerics()})
        direct = inner[0]
        if not _called_directly(direct, example, outputs()):
            return lambda inputs: wrapped(*inputs)
    # the generated module's `call` itself, where inductor hands it on: the CompiledFxGraph around it checks debug
    # and autotune-cache state no CPU graph of ours has, about 1 us a call (more inside a step, code gone cold).
    # It is boxed: it empties the list it is given, which each caller makes for the call.
    return getattr(direct, "current_callable", None) or direct


def _in_chunks(chunk_rows: Callable[..., int | None] | None, tensors: list[torch.Tensor], args: tuple,
               kwargs: dict) -> list[int | None] | None:
    """Where a graph runs x in chunks of rows, the rows of each tensor's chunks (x's first; None: a scalar, handed
    to every chunk whole); None where it runs x whole. In chunks: past CHUNKED_FROM values on the CPU, where the
    quantiser says how many rows a chunk must hold a multiple of (`chunk_rows(x, *args, **kwargs)`: its blocks'
    rows along dim 0, 1 along the last; None: not for these arguments), x is contiguous with two dimensions or
    more and holds more than one chunk of at least CHUNK_VALUES values, and each other tensor is a scalar or a
    stochastic rounding's draws, laid out as x's blocks are (`blocks._draws_over`: a row of blocks a row), cut
    alike."""
    x = tensors[0]
    if (chunk_rows is None or x.numel() < CHUNKED_FROM or x.device.type != "cpu" or x.dim() < 2
            or not x.is_contiguous()):
        return None
    granule = chunk_rows(x, *args, **kwargs)
    if granule is None:
        return None
    least = -(-CHUNK_VALUES * x.shape[0] // x.numel())  # rows holding CHUNK_VALUES values, rounded up
    rows = -(-least // granule) * granule
    if rows >= x.shape[0]:
        return None
    cuts, block_rows = [rows], -(-x.shape[0] // granule)
    for t in tensors[1:]:
        if t.numel() == 1:
            cuts.append(None)
        elif t.dim() > 1 and t.shape[0] == block_rows and t.is_contiguous():
            cuts.append(rows // granule)
        else:
            return None
    return cuts


_VIEWS = (torch.ops.aten.alias.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _unviewed(node):
    """The tensor that a chain of views ends in, going back from node through views of contiguous tensors (a view
    of one keeps its values' order) and slices that keep every value."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        whole_slice = (node.target is torch.ops.aten.slice.Tensor
                       and source.meta["val"].shape == node.meta["val"].shape)
        if not (node.target in _VIEWS or whole_slice) or not source.meta["val"].is_contiguous():
            break
        node = source
    return node


def _concatenated_unviewed(graph) -> None:
    """Rewrite, in place, a concatenation along dim 0 of views of contiguous tensors as the view of their
    concatenation, where those tensors differ only along dim 0: the same values in the same order. Inductor writes
    each tensor it concatenates into its place in the result, but a view of one it first writes apart and then
    copies: a block quantiser's values are its blocks (rows, blocks, 16) viewed as x's shape, and that copy made the
    chunks slower than x whole."""
    for node in list(graph.graph.nodes):
        if node.target is not torch.ops.aten.cat.default or (len(node.args) > 1 and node.args[1] != 0):
            continue
        parts = node.args[0]
        unviewed = [_unviewed(part) for part in parts]
        if (unviewed == list(parts) or len({u.meta["val"].shape[1:] for u in unviewed}) != 1
                or not all(part.meta["val"].is_contiguous() for part in parts)):
            continue
        with graph.graph.inserting_before(node):
            joined = graph.graph.call_function(torch.ops.aten.cat.default, (unviewed, 0))
            viewed = graph.graph.call_function(torch.ops.aten.view.default, (joined, list(node.meta["val"].shape)))
        node.replace_all_uses_with(viewed)
        graph.graph.erase_node(node)
    graph.graph.eliminate_dead_code()
    graph.recompile()


@dataclasses.dataclass
class _Trial:
    """A layout's graph on trial (`Specialisation._on_trial`): its calls so far, its fastest, and the fastest of the
    layout's eager calls before it was made."""

    graph: Callable
    fastest_eager: float
    calls: int = 0
    fastest: float = math.inf


def _eager_numerics() -> dict:
    """Inductor's options that make Triton compute as eager CUDA and the CPU do, where its defaults do not:
    - `division_rounding`: FP32 division correctly rounded (div_rn), where Triton divides approximately (div.full):
      the quantisers divide by tensors (NVFP4's block scale by its tensor scale, `448 / amax` as one division:
      blocks._quotient). (A division by a constant is a multiplication by its reciprocal on CUDA whatever this says,
      eagerly and compiled, so the quantisers divide by one in float64: blocks._divided_by.) Named
      `emulate_divison_rounding` in some earlier releases;
    - `disable_ftz`: libdevice's functions (the log2 and exp2 of torchao's power-of-two scale) keep subnormals, which
      Triton's defaults flush and eager CUDA does not.
    Each set where this torch has it (torch 2.13 has both; absent, nothing to set). No effect on the CPU's code."""
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    if numerics is None:
        return {"emulate_divison_rounding": True} if hasattr(config, "emulate_divison_rounding") else {}
    return {f"eager_numerics.{name}": True for name in ("division_rounding", "disable_ftz") if hasattr(numerics, name)}


_ONE_TENSOR = "one tensor"  # the `rebuild` of an fn that returns one tensor: its graph's only output


def _rebuild(kind: type, is_tuple: bool, written: list[bool]) -> Callable | None:
    """How fn's result (a tuple or a dataclass; `written`: which of its items are tensors, not None) is made again
    from its graph's outputs, the tensors in order: None where the outputs are it (a tuple without a None)."""
    if is_tuple:
        return None if all(written) else lambda outputs: _in_place_of_none(written, outputs)
    if all(written):
        return lambda outputs: kind(*outputs)
    return lambda outputs: kind(*_in_place_of_none(written, outputs))


def _returning(rebuild, call: Callable) -> Callable:
    """call (a compiled graph of a list of tensors) returning what fn returned, by `rebuild` (`_ONE_TENSOR`, None or
    a function: `_rebuild`); call itself where its outputs are that (no frame more a call)."""
    if rebuild is _ONE_TENSOR:
        return lambda inputs: call(inputs)[0]
    return call if rebuild is None else lambda inputs: rebuild(call(inputs))


def _in_place_of_none(written: list[bool], outputs) -> tuple:
    """fn's tuple, or its dataclass's fields, in order: the graph's outputs where it wrote one, None where not."""
    outputs = iter(outputs)
    return tuple([next(outputs) if w else None for w in written])


def _called_directly(compiled: Callable, tensors: list[torch.Tensor], outputs: int) -> bool:
    """Whether inductor's compiled graph, called on the quantiser's own tensors, gives all its outputs. Not where
    AOTAutograd's wrappers add inputs (a constant tensor the trace captured, lifted to an input) or remake an output
    (one aliasing another): Transformer Engine's NVFP4 quantisers keep the wrappers."""
    try:
        return len(compiled(list(tensors))) == outputs
    except Exception:  # wrong arguments: inductor's code unpacks the inputs it was compiled for
        return False


class Bound:
    """`quantiser(x, *args, **kwargs)` with the arguments after x fixed (`quantiser.bind(*args, **kwargs)`), for a
    caller that rounds tensors of one layout again and again: an emulated GEMM's rounding site, every step. A call on
    the layout of the last call runs the graph compiled for it without the quantiser's lookups (its threshold, static
    key, Specialisation and layout: about 3 of a small call's 8 us; inside an emulated LeNet FP8 step, a sixth of its
    fifteen roundings' time and 1.3% of the step). What can change from one call to the next is checked on each: the
    switch, a graph being traced, a gradient being recorded. Any other call is the quantiser's own, and so is a call
    that draws, takes a tensor argument, or has a 16-bit x (compiled on its FP32 widening). The same graph on the
    same tensor: the quantiser's bits."""

    def __init__(self, quantiser: Callable, args: tuple, kwargs: dict, least: int | None):
        """least: the fewest elements the quantiser compiles for these arguments (None: it never runs them compiled
        as they stand: they draw, hold a tensor, or cannot be hashed)."""
        self.quantiser, self.args, self.kwargs, self.least = quantiser, args, kwargs, least
        self.key = _static_key(args, kwargs)
        self.layout, self.graph = None, None  # the last call's x, where the quantiser runs it compiled

    def __call__(self, x: torch.Tensor):
        if in_graph():  # being traced (a compiled model's step): the quantiser's eager body, taken into the graph
            return self.quantiser(x, *self.args, **self.kwargs)
        layout = _layout([x])
        # of `_runs_eagerly`, what can change between calls on one layout (tracing is asked above; the size and the
        # device are the layout's): asked again here in full, it made a call 0.9 of 3.4 us slower
        if layout == self.layout and enabled() and not (x.requires_grad and torch.is_grad_enabled()):
            return self.graph([x])
        result = self.quantiser(x, *self.args, **self.kwargs)  # compiles x's layout where the quantiser would
        self.graph = self._compiled(x, layout)
        self.layout = layout if self.graph is not None else None
        return result

    def _compiled(self, x: torch.Tensor, layout: tuple) -> Callable | None:
        """The graph the quantiser ran x on (None: it ran x eagerly, or has not compiled it)."""
        if self.least is None or _runs_eagerly(x, self.least):
            return None  # (a 16-bit x's layout has no graph: its quantiser compiled its FP32 widening's)
        specialisation = self.quantiser.compiled.get(self.key)
        return None if specialisation is None else specialisation.graphs.get(layout)


def _fell_back(fn: Callable, key, error: Exception) -> None:
    """Say that fn's graph for `key` failed to compile (make_fx or inductor cannot compile it here) and runs eagerly."""
    FELL_BACK.append(f"{fn.__name__}{key}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    logger.warning("fused %s fell back to eager: %s", fn.__name__, FELL_BACK[-1])


def run_specialised(specialisations: dict, key: tuple, fn: Callable, x: torch.Tensor, *args):
    """fn(x, *args), a function of tensors without state or draws, as its graph for x's layout: the Specialisation kept
    for `key` in `specialisations` (made on the first call; None once it failed to compile). fn itself where fused
    code does not run (`_runs_eagerly` at any size: switched off, off the CPU, traced, recording a gradient) or
    cannot compile. For a caller that knows fn's other arguments by `key` (an emulated op's forward and backward
    passes, bench/numerics/emulation.py)."""
    if _runs_eagerly(x, ARITHMETIC_FROM):
        return fn(x, *args)
    specialisation = specialisations.get(key, _UNSEEN)
    if specialisation is _UNSEEN:
        specialisation = specialisations[key] = Specialisation(fn, args, {})
    if specialisation is not None:
        try:
            return specialisation(x, *args)
        except Exception as e:
            specialisations[key] = None
            _fell_back(fn, key, e)
    return fn(x, *args)


class Passes:
    """`run_specialised` for a caller that runs the same passes on the same layouts step after step (an emulated
    op's forward and backward, bench/numerics/emulation.py), each pass's last graph kept at hand, as a `Bound` keeps
    a quantiser's. A call on the layout of its pass's last call asks only what can change between calls (a graph
    being traced, the switch, a gradient being recorded) and runs that graph: no Specialisation lookup and four
    Python frames fewer a pass, which inside a step, the code gone cold after each convolution, cost more than hot
    (docs/performance.md). Any other call is `run_specialised`'s."""

    def __init__(self):
        self.specialisations: dict = {}  # per pass's key: its Specialisation (run_specialised's)
        self.kept: dict = {}  # per pass's key: its last call's layout, that layout's graph, where its tensors sit

    def run(self, key: tuple, fn: Callable, x: torch.Tensor, *args):
        """fn(x, *args) as `run_specialised(self.specialisations, key, fn, x, *args)` runs it."""
        kept = self.kept.get(key)
        if kept is not None and not in_graph() and enabled() and not (x.requires_grad and torch.is_grad_enabled()):
            layout, graph, slots = kept
            tensors = [x, *map(args.__getitem__, slots)]
            if _layout(tensors) == layout:
                return graph(tensors)
        result = run_specialised(self.specialisations, key, fn, x, *args)
        self.kept[key] = self._kept(key, x, args)
        return result

    def _kept(self, key: tuple, x: torch.Tensor, args: tuple) -> tuple | None:
        """What `run` keeps of the call just run (None: it ran eagerly, and the next call asks again)."""
        specialisation = self.specialisations.get(key)
        if specialisation is None or _runs_eagerly(x, ARITHMETIC_FROM):
            return None
        tensors = [x, *map(args.__getitem__, specialisation.slots)]
        layout = _layout(tensors)
        graph = specialisation.graphs.get(layout)
        return None if graph is None else (layout, graph, specialisation.slots)


def fused(from_elements: int | Callable[..., int], values_alone: bool = False,
          draws: Callable[[torch.Tensor, dict], torch.Tensor] | None = None,
          chunk_rows: Callable[..., int | None] | None = None) -> Callable[[Callable], Callable]:
    """Decorate quantiser `fn(x, ...)`: its compiled twin where it pays (the module docstring says when), `fn`
    otherwise. from_elements: the fewest elements compiled, or a function of the call's other arguments giving it.
    draws: for a quantiser with a `draw` parameter, `draws(x, arguments)` (its arguments by name, defaults filled
    in) makes the stochastic draws its eager body would make; a stochastic call is then fused, given them.
    `quantiser.eager` is `fn` with every quantiser it calls eager too, `quantiser.fused` the compiled path whatever
    the call (the tests' and the benchmark's; a stochastic call's draws made eagerly first, as the quantiser makes
    them), `quantiser.compiled` its Specialisations so far (None: one that failed to compile, eager),
    `quantiser.bind(...)` a `Bound` quantiser (its arguments after x fixed, for a caller that calls it on one layout
    again and again).
    With `values_alone` (a quantiser returning a blocks.Blocked), `quantiser.values` is the same call returning only its
    `values` (with its own `.eager`, `.fused` and `.compiled`): what a training step's GEMM reads. Fused, its graph
    writes one tensor where the whole Blocked writes two and the per-block fields, which also keep inductor from
    running the block amax and the elements in one loop: MX's values alone ran 1.9x faster (docs/performance.md).
    chunk_rows: for the values alone, `chunk_rows(x, *args, **kwargs)`, how many rows a chunk of x must hold a
    multiple of for its blocks to lie whole in it (None: not to be chunked), where x past the caches is to be
    quantised in chunks (`_in_chunks`)."""
    def decorate(fn: Callable) -> Callable:
        quantiser = _dispatch(fn, from_elements, None, draws)
        if values_alone:
            quantiser.values = _dispatch(fn, from_elements, "values", draws, chunk_rows)
        return quantiser
    return decorate


def _dispatch(fn: Callable, from_elements: int | Callable[..., int], pick: str | None,
              draws_for: Callable[[torch.Tensor, dict], torch.Tensor] | None = None,
              chunk_rows: Callable[..., int | None] | None = None) -> Callable:
    """`fused`'s quantiser for fn, returning its result's field `pick` alone where pick is given."""
    signature = inspect.signature(fn)
    compiled: dict[tuple, Callable | None] = {}  # per static key; None: it failed to compile, eager
    eager = _picking(fn, pick)

    # where `rounding` and `generator` sit among the arguments after x (None: fn has no such parameter)
    position = {name: (list(signature.parameters).index(name) - 1 if name in signature.parameters else None)
                for name in ("rounding", "generator")}

    def chosen(name: str, args: tuple, kwargs: dict, default):
        at = position[name]
        if at is None:
            return default
        return args[at] if at < len(args) else kwargs.get(name, default)

    def draws(args, kwargs) -> bool:
        return (chosen("rounding", args, kwargs, "nearest") != "nearest"
                or chosen("generator", args, kwargs, None) is not None)

    def drawn_eagerly(args, kwargs) -> bool:
        """Whether the call is a stochastic rounding whose draws `with_draws` makes, to hand to its graph."""
        return draws_for is not None and chosen("rounding", args, kwargs, "nearest") == "stochastic"

    def run_fused(x: torch.Tensor, *args, **kwargs):
        key = _static_key(args, kwargs)
        try:
            specialisation = compiled.get(key, _UNSEEN)  # hashed once a call (a FormatSpec's hash is ~1 us)
        except TypeError:  # an argument that cannot be hashed: no key, eager
            return eager(x, *args, **kwargs)
        if specialisation is _UNSEEN:
            specialisation = compiled[key] = Specialisation(fn, args, kwargs, pick, chunk_rows)
        if specialisation is not None:
            try:
                if x.dtype in SIXTEEN_BIT:  # FP32 in, and back: inductor's 16-bit code is slower than eager
                    result = specialisation(x.float(), *args, **kwargs)  # (counts, and a Blocked's FP32
                    return result.to(x.dtype) if pick is None and isinstance(result, torch.Tensor) and \
                        result.is_floating_point() else result  # fields, stay as they are)
                return specialisation(x, *args, **kwargs)
            except Exception as e:  # make_fx or inductor cannot compile it here: eager from now on
                compiled[key] = None
                _fell_back(fn, key, e)
        return eager(x, *args, **kwargs)

    def with_draws(x: torch.Tensor, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name (x's aside) with its draws made, eagerly, as its eager body would make them,
        and no generator left to draw from."""
        arguments = signature.bind(x, *args, **kwargs)
        arguments.apply_defaults()
        named = dict(list(arguments.arguments.items())[1:])
        named["draw"] = draws_for(x, named)
        named["generator"] = None
        return named

    @functools.wraps(fn)
    def quantiser(x: torch.Tensor, *args, **kwargs):
        least = from_elements if isinstance(from_elements, int) else from_elements(*args, **kwargs)
        if _runs_eagerly(x, least):
            return eager(x, *args, **kwargs)
        if draws(args, kwargs):
            if not drawn_eagerly(args, kwargs):
                return eager(x, *args, **kwargs)
            return run_fused(x, **with_draws(x, args, kwargs))
        return run_fused(x, *args, **kwargs)

    def bind(*args, **kwargs) -> Bound:
        """The quantiser with these arguments after x, for calls on one layout after another (`Bound`)."""
        least = from_elements if isinstance(from_elements, int) else from_elements(*args, **kwargs)
        try:
            hash(_static_key(args, kwargs))
        except TypeError:  # no key: every call eager
            least = None
        if draws(args, kwargs) or any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            least = None
        return Bound(quantiser, args, kwargs, least)

    def fused_path(x: torch.Tensor, *args, **kwargs):
        """`run_fused` whatever the call, a stochastic call's draws made first as `quantiser` makes them: a generator
        handed to the traced graph drew other bits than the eager quantiser."""
        if drawn_eagerly(args, kwargs):
            return run_fused(x, **with_draws(x, args, kwargs))
        return run_fused(x, *args, **kwargs)

    quantiser.eager, quantiser.fused = _wholly_eager(eager), fused_path
    quantiser.compiled, quantiser.bind = compiled, bind
    return quantiser
