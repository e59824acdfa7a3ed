"""Model configuration for MOSS-Speech and the special token ids every package shares.

The field names of `ModelConfig` follow the Hugging Face `config.json` of the checkpoint
(see docs/contracts.md and the facts sheet), so a config round-trips through `from_hf_dict`
/ `to_hf_dict` without renaming.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = tuple[int, int]
"""One position of a sequence: (text token id, audio token id)."""

MODALITY_PAD_ID = 151667  # text channel of an audio row: the row embeds its audio token
SOSP_ID = 151646  # <|object_ref_start|>: text mode -> audio mode
EOSP_ID = 16384  # audio channel: audio mode -> text mode
AUDIO_PAD_ID = 512  # audio channel filler in text rows of audio prompts
IM_START_ID = 151644
IM_END_ID = 151645
ENDOFTEXT_ID = 151643
NUM_AUDIO_CODES = 16384  # valid generated codec codes are 0..16383
CODES_PER_SECOND = 12.5  # codec frame rate: one code is 80 ms of speech

MODEL_TYPE = "moss_speech"
ARCHITECTURE = "MossSpeechForCausalLM"

# HF config.json fields that map one-to-one onto ModelConfig fields.
_HF_FIELDS = (
    "vocab_size",
    "audio_vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_shared_layers",
    "num_modality_layers",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "modality_pad_token_id",
    "sosp_token_id",
    "eosp_token_id",
)


class ConfigError(ValueError):
    """A config.json or preset does not describe a model this runtime can build."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of one MOSS-Speech model (defaults: the released 9.1B checkpoint)."""

    vocab_size: int = 151680
    audio_vocab_size: int = 16512
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    num_shared_layers: int = 32
    num_modality_layers: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    modality_pad_token_id: int = MODALITY_PAD_ID
    sosp_token_id: int = SOSP_ID
    eosp_token_id: int = EOSP_ID

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "audio_vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_shared_layers", "num_modality_layers",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite positive number, got {value!r}")
        if not 0 <= self.modality_pad_token_id < self.vocab_size:
            raise ConfigError(f"modality_pad_token_id {self.modality_pad_token_id} outside the text vocab")
        if not 0 <= self.sosp_token_id < self.vocab_size:
            raise ConfigError(f"sosp_token_id {self.sosp_token_id} outside the text vocab")
        if not 0 <= self.eosp_token_id < self.audio_vocab_size:
            raise ConfigError(f"eosp_token_id {self.eosp_token_id} outside the audio vocab")
        # the prompts, the modality state machine and the sampler use these ids as constants
        for name, used in (("modality_pad_token_id", MODALITY_PAD_ID), ("sosp_token_id", SOSP_ID),
                           ("eosp_token_id", EOSP_ID)):
            if getattr(self, name) != used:
                raise ConfigError(f"{name} {getattr(self, name)} is not the id this runtime uses ({used})")

    @property
    def num_hidden_layers(self) -> int:
        """HF `num_hidden_layers`: shared layers plus ONE tail (36 for the real model)."""
        return self.num_shared_layers + self.num_modality_layers

    @property
    def num_layer_instances(self) -> int:
        """Layers that own a KV cache slot: shared + text tail + audio tail (40 for the real model)."""
        return self.num_shared_layers + 2 * self.num_modality_layers

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json, validating the fields this runtime depends on."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            raise ConfigError(f"unsupported model_type {model_type!r}; expected {MODEL_TYPE!r}")
        missing = [name for name in (*_HF_FIELDS, "num_hidden_layers") if name not in d]
        if missing:
            raise ConfigError(f"config.json lacks required fields: {', '.join(sorted(missing))}")
        if d.get("tie_word_embeddings", False):
            raise ConfigError("tie_word_embeddings=true is not supported: MOSS-Speech has 4 untied tables")
        if d.get("rope_scaling") is not None:
            raise ConfigError(f"rope_scaling {d['rope_scaling']!r} is not supported (expected null)")
        if d.get("use_sliding_window", False):
            raise ConfigError("use_sliding_window=true is not supported: every MOSS-Speech layer attends to all keys")
        rope_parameters = d.get("rope_parameters")  # newer transformers' form of rope_theta + rope_scaling
        if rope_parameters is not None and (
            not isinstance(rope_parameters, dict)
            or rope_parameters.get("rope_type", "default") != "default"
            or set(rope_parameters) - {"rope_type", "rope_theta", "partial_rotary_factor"}
            or rope_parameters.get("partial_rotary_factor", 1.0) != 1.0
            or rope_parameters.get("rope_theta", d.get("rope_theta")) != d.get("rope_theta")
        ):
            raise ConfigError(f"rope_parameters {rope_parameters!r} is not supported (expected the default rope "
                              f"with rope_theta {d.get('rope_theta')!r})")
        if d.get("attention_bias", False):
            raise ConfigError("attention_bias=true is not supported: MOSS-Speech projections have no bias")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (expected 'silu')")
        config = cls(**{name: d[name] for name in _HF_FIELDS})
        if config.num_hidden_layers != d["num_hidden_layers"]:
            raise ConfigError(
                f"num_shared_layers ({config.num_shared_layers}) + num_modality_layers "
                f"({config.num_modality_layers}) != num_hidden_layers ({d['num_hidden_layers']})"
            )
        return config

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            with config_path.open(encoding="utf-8") as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{config_path} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json content for this config (HF field names)."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "rope_scaling": None,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
        }
        d.update({name: getattr(self, name) for name in _HF_FIELDS})
        return d

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """`full`: the released checkpoint's shape. `tiny`: same vocabs, ids and layer count, small widths."""
        if name == "full":
            return cls()
        if name == "tiny":
            return cls(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=8192,
            )
        raise ConfigError(f"unknown model preset {name!r}; expected 'tiny' or 'full'")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def check_field_types(config: Any) -> None:
    """ValueError naming the first field of dataclass `config` whose value is not of its annotated kind: an int
    field takes an int (not a bool: True would be 1, nor a float: 2.5 rows), a float field a finite number
    (NaN passed every `x < 1` check, and an infinite timeout never ends), a bool field a bool, a str field a
    str; None where the annotation allows it. Other annotations are left to the config's own checks."""
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        kinds = [kind.strip() for kind in str(item.type).split("|")]
        if value is None and "None" in kinds:
            continue
        kind = kinds[0]
        if kind == "int":
            ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            what = "a finite number"
        elif kind in ("bool", "str"):
            ok, what = type(value) is bool if kind == "bool" else isinstance(value, str), f"a {kind}"
        else:
            continue
        if not ok:
            raise ValueError(f"{item.name} must be {what}{' or None' if 'None' in kinds else ''}, got {value!r}")

