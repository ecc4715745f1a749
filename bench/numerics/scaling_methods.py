"""Scaling methods, each declared once: a class registered under its name(s), with a frozen dataclass of its knobs
(`Knobs`; a user's method may add `Options`, its own knobs under `scaling.options`), built by Hydra's `instantiate`
from conf/scaling/<name>.yaml (its `_target_` names the class, its other keys are the knobs). Everything the rest of
the suite does differently for a scaling method, it asks the method:

- what it asks of the precision plan (bench/numerics/plan.py): a scale on every quantised tensor (`site_scale`:
  per_tensor's amax scale), or FP8 operands scaled per row or tile (`tiles`), and the torchao recipe that runs it
  natively (`torchao_recipe`);
- its model transform (`transform`: unit scaling, u-μP) and its optimiser's parameter groups (`parameter_groups`:
  u-μP's per-parameter learning rates);
- its loss scaler (`loss_scaler`: none, static, dynamic, and MindSpore's two, which are yaml variants of the last
  two);
- the checks it makes (`check`, `combines_with`).

The registry's order is the tables' order. A scaling method of your own is one subclass, registered with
`@register("name")` in a module every process of a run imports (your model's module), and one yaml with its
`_target_` (docs/extending.md). Hydra's schema for `scaling` (bench/running/config.py ScalingConfig) is the union of
the built-in methods' knobs, so that every record has the same keys; a method refuses another's key set away from its
default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from bench.errors import ConfigError, check_choice, located, suggestion
from bench.numerics.blocks import TileScaling
from bench.numerics.formats import ElementFormat
from bench.numerics.scaling import AMAX_MODES, LOSS_SCALING, LossScaler, PerTensorScale
from bench.numerics.umup import UmupHyper, umup_parameter_groups, umup_task
from bench.numerics.unit import ADAM_FAMILY, LR_RULES, POST_NORM_TAU, unit_scale_task

SCALING_METHODS: dict[str, type["ScalingMethod"]] = {}  # name -> class, in declaration (the tables') order
NO_SCALING = "none"  # the baseline: nothing scaled (the tables' reference column)


def register(*names: str) -> Callable[[type], type]:
    """Declare a scaling method: the class serves each of `names` (`scaling.name`)."""
    def declare(cls: type) -> type:
        if getattr(cls, "site_scales", False) and cls.site_scale is ScalingMethod.site_scale:
            raise ValueError(f"scaling method {cls.__qualname__} sets site_scales = True but does not override "
                             "site_scale, so no site would be scaled; give it site_scale (docs/extending.md)")
        for name in names:
            if name in SCALING_METHODS and SCALING_METHODS[name] is not cls:
                raise ValueError(f"scaling method {name!r} is already declared by {SCALING_METHODS[name].__qualname__}")
            SCALING_METHODS[name] = cls
        return cls
    return declare


def scaling_order(names) -> list[str]:
    """`names` in the registry's order, any not declared in this process (a user's, not imported here) after them."""
    names = set(names)
    return [n for n in SCALING_METHODS if n in names] + sorted(names - set(SCALING_METHODS))


@dataclass(frozen=True)
class LossScaleKnobs:
    """The knobs every scaling method has: its loss scaler's (bench/numerics/scaling.py LossScaler)."""

    loss_scaling: str = "none"  # none | static | dynamic
    init_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass(frozen=True)
class PerTensorKnobs(LossScaleKnobs):
    amax: str = "current"  # current | delayed
    history_len: int = 16  # delayed: amaxes remembered
    margin: int = 0  # s = (max / amax) / 2^margin
    pow2: bool = False  # round s down to a power of two


@dataclass(frozen=True)
class UnitKnobs(LossScaleKnobs):
    conversion_tolerance: float = 1e-4  # pretrained: largest relative output change the conversion may make
    lr_rule: str = "same"  # from scratch, Adam/AdamW: same | relative (bench.numerics.unit.relative_lr_multipliers)
    post_norm_tau: float = POST_NORM_TAU  # from scratch, transformers' post-norm encoders: a branch's share


@dataclass(frozen=True)
class UmupKnobs(LossScaleKnobs):
    """u-μP's hyper-parameters (bench.numerics.umup.UmupHyper): None in the schema, the paper's 1.0 in
    conf/scaling/umup.yaml (a record names the values it trained with)."""

    residual_mult: Optional[float] = None
    residual_attn_ratio: Optional[float] = None
    attn_softmax_mult: Optional[float] = None
    ffn_act_mult: Optional[float] = None
    output_mult: Optional[float] = None


BUILT_IN_KNOBS = (LossScaleKnobs, PerTensorKnobs, UnitKnobs, UmupKnobs)


def knob_fields() -> list:
    """The built-in methods' knobs, each once, in declaration order."""
    return list({f.name: f for knobs in BUILT_IN_KNOBS for f in fields(knobs)}.values())


def scaling_schema() -> type:
    """Hydra's structured config for `scaling` (bench/running/config.py): the union of the built-in methods' knobs,
    so that every record has the same keys (a method refuses another's key set away from its default), a mutable
    dataclass as Hydra needs; a method of your own takes its own knobs under `options`."""
    schema = make_dataclass("ScalingConfig", [
        ("name", str, field(default="???")),  # omegaconf's MISSING: the yaml names its method
        ("_target_", Optional[str], field(default=None)),  # the method's class (how it runs, not part of an identity)
        *[(f.name, f.type, field(default=f.default)) for f in knob_fields()],
        ("options", Optional[Any], field(default=None))])  # a user's method's own knobs (its `Options` dataclass)
    schema.__module__ = __name__  # its annotations resolve in this module
    return schema


class ScalingMethod:
    """A scaling method with its knobs (conf/scaling/<name>.yaml). The base class scales nothing and runs the loss
    scaler its `loss_scaling` knob names; subclasses override what they change."""

    site_scales: ClassVar[bool] = False  # a scale on every quantised tensor: needs emulation on torch's native paths
    tiles: ClassVar[TileScaling | None] = None  # FP8 operands scaled per row or tile (an FP8-only recipe)
    torchao_recipe: ClassVar[str | None] = None  # torchao's float8 recipe that runs it natively, where one does
    native_recipe: ClassVar[str | None] = None  # how the record describes that native recipe
    Knobs: ClassVar[type] = LossScaleKnobs  # its knobs: a frozen dataclass (a subclass of LossScaleKnobs)
    Options: ClassVar[type | None] = None  # a user's method's own knobs (`scaling.options`): a dataclass, or none
    title: ClassVar[str] = ""  # how messages name it ("" : scaling=<name>)
    parametrisation: ClassVar[str] = "standard (SP)"  # what the tables call the model it trains (lr transfer)
    lr_meaning: ClassVar[str] = "learning rate"  # what model.optimizer.lr means under it (the figures' axis)

    def __init__(self, name: str, options: dict | None = None, **knobs):
        """`knobs`: this method's (`Knobs`' fields; any other key is refused, naming the valid ones); `options`: a
        user's method's own (`Options`' fields, validated and typed as Hydra validates the schema)."""
        self.name = name
        self.knobs = _knobs(type(self), name, knobs)
        self.options = _options(type(self), name, options)

    @classmethod
    def combines_with(cls, spec) -> str | None:
        """Why this method does not combine with format `spec` (bench/numerics/specs.py FormatSpec), or None."""
        if spec.block and (cls.site_scales or cls.tiles):
            return "block formats scale every block themselves (a scale per tensor, row or tile would add nothing)"
        if cls.tiles and not spec.tile_scalings:
            return "rowwise and block scaling are FP8 recipes (E4M3 with a scale per row or tile)"
        return None

    def check(self) -> None:
        """Its knobs' values, before anything trains (ConfigError naming the valid choices)."""
        check_choice(self.knobs.loss_scaling, LOSS_SCALING, "scaling.loss_scaling")
        if self.knobs.loss_scaling != LOSS_SCALING[0] and self.knobs.init_scale <= 0:
            raise ConfigError(f"scaling.init_scale={self.knobs.init_scale} must be > 0")

    def loss_scaler(self, loss_multiplier: float = 1.0, max_grad_norm: float | None = None,
                    reads_every: int = 16) -> LossScaler:
        """The loss scaler the cell trains with, made once per cell: `LossScaler(loss_scaling, ...)` with this
        method's init_scale, growth_factor, backoff_factor and growth_interval. Pass the arguments on to it (the
        run's train.loss_multiplier, train.grad_clip and log_every). A rule of your own: return a LossScaler subclass
        that overrides `update_scale` (docs/extending.md)."""
        k = self.knobs
        return LossScaler(k.loss_scaling, k.init_scale, k.growth_factor, k.backoff_factor, k.growth_interval,
                          loss_multiplier=loss_multiplier, max_grad_norm=max_grad_norm, reads_every=reads_every)

    def site_scale(self, tensor_class: str, element: ElementFormat,
                   observe: Callable[[torch.Tensor, torch.Tensor], None]) -> object | None:
        """The scaler of one emulated rounding site (`tensor_class`: weights, activations or gradients, cast to
        `element`): an object whose `scale_for(x)` gives the factor x is multiplied by before the cast and divided by
        after (a tensor broadcastable to x), `observe(amax, scale)` the telemetry's; None: the site casts unscaled."""
        return None

    def transform(self, task, pretrained: bool, optimizer: str | None) -> dict | None:
        """Change the task's model (and loss) in place before it trains; what the record says of it, or None.
        `pretrained`: the model holds a checkpoint's weights; `optimizer`: model.optimizer.name, or None where the
        model is only traced (bench/speed/trace.py: its ops, no learning-rate rule)."""
        return None

    def parameter_groups(self, groups: list[dict], lr: float) -> list[dict]:
        """The optimiser's parameter groups (each {"params", "lr", "weight_decay"}) as this method trains them."""
        return groups


@register("none", "static", "dynamic")
class LossScaling(ScalingMethod):
    """No scaling, or a loss scale (static: fixed; dynamic: GradScaler's), as `loss_scaling` says."""


@register("per_tensor")
class PerTensor(ScalingMethod):
    """s = (max / amax) / 2^margin on every quantised tensor, amax current (torchao's tensorwise) or delayed
    (Transformer Engine's history)."""

    Knobs = PerTensorKnobs
    site_scales = True
    title = "per-tensor scaling"
    torchao_recipe = "tensorwise"
    native_recipe = "torchao float8 tensorwise (per-tensor dynamic scaling)"

    def check(self) -> None:
        super().check()
        check_choice(self.knobs.amax, AMAX_MODES, "scaling.amax")

    def site_scale(self, tensor_class, element, observe):
        k = self.knobs
        return PerTensorScale(element, k.amax, k.history_len, k.margin, k.pow2, on_scale=observe)


@register("unit")
class UnitScaling(ScalingMethod):
    """Unit scaling (Blake et al., ICML 2023): unit-variance init, scaled ops, no loss scale
    (bench/numerics/unit.py)."""

    Knobs = UnitKnobs
    parametrisation = "unit scaling"

    def check(self) -> None:
        super().check()
        check_choice(self.knobs.lr_rule, LR_RULES, "scaling.lr_rule")
        if not self.knobs.conversion_tolerance > 0:
            raise ConfigError(f"scaling.conversion_tolerance={self.knobs.conversion_tolerance} must be > 0")
        if not 0 < self.knobs.post_norm_tau < 1:
            raise ConfigError(f"scaling.post_norm_tau={self.knobs.post_norm_tau} must be in (0, 1) (a residual "
                              f"branch's share of the variance; default {POST_NORM_TAU})")

    def transform(self, task, pretrained, optimizer):
        relative_lr = self.knobs.lr_rule == "relative" and optimizer in ADAM_FAMILY
        source = task.source or {}
        if pretrained and source.get("parametrisation") == self.parametrisation:  # pretrained unit-scaled here
            return unit_scale_task(task, preserve=False, keep_weights=True, relative_lr=relative_lr,
                                   post_norm_tau=source.get("post_norm_tau", POST_NORM_TAU))
        return unit_scale_task(task, preserve=pretrained, tolerance=self.knobs.conversion_tolerance,
                               relative_lr=relative_lr, post_norm_tau=self.knobs.post_norm_tau)


@register("umup")
class Umup(ScalingMethod):
    """u-μP (Blake et al., ICLR 2025): unit scaling made width-transferable (bench/numerics/umup.py)."""

    Knobs = UmupKnobs
    parametrisation = "u-μP"
    lr_meaning = "learning rate (u-μP's global η)"

    @property
    def hyper(self) -> UmupHyper:
        return UmupHyper(**{f.name: getattr(self.knobs, f.name) for f in fields(UmupHyper)})

    def check(self) -> None:
        super().check()
        for key in (f.name for f in fields(UmupHyper)):
            value = getattr(self.knobs, key)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"scaling.{key}={value} must be a number > 0 under scaling=umup (the paper's "
                                  "default: 1.0)")

    def transform(self, task, pretrained, optimizer):
        if pretrained:
            raise ConfigError("scaling=umup trains from scratch (fresh N(0, 1) weights: a checkpoint's would be "
                              "thrown away); valid: model.pretrained=false, or scaling=unit, which converts a "
                              "pretrained checkpoint keeping its function")
        try:
            return umup_task(task, self.hyper)
        except ConfigError as e:
            others = [n for n, cls in SCALING_METHODS.items() if cls.transform is ScalingMethod.transform]
            raise ConfigError(f"{e}; valid for any model (they leave it as it is): {', '.join(others)}") from None

    def parameter_groups(self, groups, lr):
        return umup_parameter_groups(groups, lr)


@register("rowwise")
class Rowwise(ScalingMethod):
    """torchao's rowwise FP8 recipe: one power-of-two scale per row along each GEMM's reduced dimension."""

    tiles = TileScaling("row", rows=True)
    torchao_recipe = "rowwise"
    native_recipe = "torchao float8 rowwise (per-row dynamic power-of-two scaling)"


@register("rowwise_with_gw_hp")
class RowwiseWithGwHp(ScalingMethod):
    """torchao's rowwise_with_gw_hp: rowwise, the weight one scale in the input-gradient GEMM, the weight-gradient
    GEMM in high precision."""

    tiles = TileScaling("row; the weight one scale in the input-gradient GEMM; the weight-gradient GEMM in high "
                        "precision", rows=True, grad_weight_in_high_precision=True)
    torchao_recipe = "rowwise_with_gw_hp"
    native_recipe = "torchao float8 rowwise_with_gw_hp (rowwise; weight-gradient GEMM in high precision)"


@register("block")
class Block(ScalingMethod):
    """Transformer Engine's Float8BlockScaling: 1 x 128 tiles for activations and gradients, 128 x 128 for weights
    (emulated: Transformer Engine is not a dependency)."""

    tiles = TileScaling("1x128 (activations, gradients), 128x128 (weights)", rows=False)


def check_parametrisation(trained_in: str | None, method: ScalingMethod, checkpoint) -> None:
    """ConfigError for a checkpoint pretrained in another parametrisation than the standard one (a unit-scaled
    model's, which bench.tools.export_encoder marks) fine-tuned in a third: its weights compute its function only
    through that parametrisation's ops."""
    if trained_in not in (None, ScalingMethod.parametrisation, method.parametrisation):
        others = [name for name, cls in SCALING_METHODS.items() if cls.parametrisation == trained_in]
        raise ConfigError(f"the checkpoint {checkpoint} was pretrained in {trained_in}, whose weights mean nothing "
                          f"without its ops; fine-tune it with scaling={'|'.join(others)}")


def transform_task(method: ScalingMethod, task, pretrained: bool, optimizer: str | None) -> dict | None:
    """`method.transform`, once the checkpoint's parametrisation is checked (`check_parametrisation`)."""
    if pretrained:
        check_parametrisation((task.source or {}).get("parametrisation"), method, (task.source or {}).get("checkpoint"))
    return method.transform(task, pretrained, optimizer)


def scaling_class(name: str) -> type[ScalingMethod]:
    check_choice(name, tuple(SCALING_METHODS), "scaling")
    return SCALING_METHODS[name]


def _knobs(cls: type[ScalingMethod], name: str, given: dict) -> LossScaleKnobs:
    """`cls.Knobs` from `given`. A built-in method's key that is not its own is refused where it is away from the
    schema's default (Hydra's schema holds every built-in method's knobs), ignored where it is the default."""
    own = {f.name for f in fields(cls.Knobs)}
    schema = {f.name: f.default for f in knob_fields()}
    for key, value in given.items():
        if key in own or (key in schema and value == schema[key]):
            continue
        whose = [n for n, c in SCALING_METHODS.items() if key in {f.name for f in fields(c.Knobs)}]
        raise ConfigError(f"scaling.{key}={value} is not a knob of scaling={name}"
                          + (f" but of scaling={'|'.join(whose)}" if whose else suggestion(key, own, "scaling."))
                          + f"; scaling={name}'s knobs: {', '.join(sorted(own))}"
                          + (", options.*" if cls.Options else ""))
    return cls.Knobs(**{key: value for key, value in given.items() if key in own})


def _options(cls: type[ScalingMethod], name: str, given: dict | None):
    """`cls.Options` from `scaling.options`, validated and typed by OmegaConf as Hydra validates the schema (an
    unknown key or a wrong type: ConfigError naming the valid keys); None where the method declares none."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if cls.Options is None:
        if given:
            raise ConfigError(f"scaling={name} takes no scaling.options (given: {', '.join(map(str, given))}); a "
                              "method of your own declares them as a dataclass, `Options` (docs/extending.md)")
        return None
    valid = [f.name for f in fields(cls.Options)]
    for key in given or {}:
        if key not in valid:
            raise ConfigError(f"unknown key scaling.options.{key}{suggestion(key, valid, 'scaling.options.')}; "
                              f"scaling={name}'s options: {', '.join(valid)}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls.Options), given or {}))
    except OmegaConfBaseException as e:
        raise ConfigError(f"scaling.options of scaling={name}: {str(e).splitlines()[0]}") from None


def build(node) -> ScalingMethod:
    """The scaling method a config's `scaling` node declares, built by Hydra's `instantiate` from its `_target_` (a
    record made before 0.3.0 has none: the class registered under its name), the node's other keys its knobs and
    options. A user's class is imported by its `_target_`; one its module did not register is registered under the
    yaml's name, and a registered one refuses a yaml whose name is not one of its registered names."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    values = {key: value for key, value in dict(node.items()).items() if not (key == "options" and value is None)}
    target, name = values.pop("_target_", None), values["name"]
    if not target:
        return scaling_class(name)(**values)
    cls = located(target, "scaling._target_", "a scaling method's module")
    if not (isinstance(cls, type) and issubclass(cls, ScalingMethod)):
        raise ConfigError(f"scaling._target_={target} is not a bench.numerics.scaling_methods.ScalingMethod")
    if SCALING_METHODS.get(name, cls) is not cls:
        raise ConfigError(f"scaling.name={name} is {SCALING_METHODS[name].__module__}."
                          f"{SCALING_METHODS[name].__qualname__}'s, not {target}'s: give the method its own name")
    if (names := [n for n, c in SCALING_METHODS.items() if c is cls]) and name not in names:
        raise ConfigError(f"scaling.name={name}{suggestion(name, names, 'scaling.name=')}: {target} is registered as "
                          f"{', '.join(names)}, and a scaling yaml's name is its method's registered name")
    register(name)(cls)
    try:
        return instantiate({"_target_": target, **values}, _convert_="all")
    except InstantiationException as e:  # hydra wraps the constructor's own error: a refused knob is a ConfigError
        raise (e.__cause__ if isinstance(e.__cause__, ConfigError) else e) from None


def combining_with(spec) -> list[str]:
    """The scaling methods that combine with format `spec`, in the registry's order."""
    return [name for name, cls in SCALING_METHODS.items() if cls.combines_with(spec) is None]
