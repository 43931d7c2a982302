"""The training recipe as one value (docs/design.md §1), built once and handed to every layer.

`Recipe(name, scale_fmt, bf16_linears)` is validated at construction; below it nothing compares
strings: layers ask `recipe.fp8` (the routed experts and the shared experts) and
`recipe.dense_fp8(linear)` (each dense linear). `Recipe.from_config(cfg.recipe)` is what training
builds from its config (moefp8.config.RecipeConfig).
"""

from dataclasses import dataclass

from moefp8.config import DENSE_LINEARS, MOE_IMPLS, RECIPES, RecipeConfig, bf16_linears
from moefp8.fp8 import check_scale_fmt


@dataclass(frozen=True)
class Recipe:
    """name: "fp8" (the DeepSeek-V3 recipe) or "bf16" (the like-for-like baseline: the same
    pipeline with BF16 rows, GEMMs and caches). scale_fmt: the FP8 scales, "pow2" or "fp32"
    (moefp8.fp8); the dispatcher must send the same. bf16_linears: under "fp8", the dense linears
    ("wqkv", "wo", "dense_mlp") that compute in BF16 anyway (training's default: none). moe_impl:
    who computes the routed experts, "moefp8" or "megablocks" (its dMoE; BF16 only)."""

    name: str = "fp8"
    scale_fmt: str = "pow2"
    bf16_linears: frozenset[str] = frozenset()
    moe_impl: str = "moefp8"

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"recipe={self.name!r}: expected one of {RECIPES}")
        check_scale_fmt(self.scale_fmt)
        object.__setattr__(self, "bf16_linears", frozenset(self.bf16_linears))
        unknown = sorted(self.bf16_linears - set(DENSE_LINEARS))
        if unknown:
            raise ValueError(f"recipe bf16_linears entry {unknown[0]!r}: expected one of {DENSE_LINEARS}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"recipe moe_impl={self.moe_impl!r}: expected one of {MOE_IMPLS}")
        if self.moe_impl == "megablocks" and self.fp8:
            raise ValueError("recipe moe_impl='megablocks': megablocks' dMoE is BF16; use it with the bf16 recipe")

    @property
    def fp8(self) -> bool:
        """Whether the experts (routed and shared) compute in FP8."""
        return self.name == "fp8"

    def dense_fp8(self, linear: str) -> bool:
        """Whether the dense linear `linear` ("wqkv", "wo" or "dense_mlp") computes in FP8."""
        return self.fp8 and linear not in self.bf16_linears

    @classmethod
    def from_config(cls, r: RecipeConfig) -> "Recipe":
        """The recipe of a (validated) training config's `recipe` section."""
        return cls(r.recipe, r.scale_fmt, bf16_linears(r), r.moe_impl)
