"""Ollama's model management for the stand-in (`devtools.fakes.ollama`): what ``/api/pull``,
``/api/create``, ``/api/copy`` and ``/api/delete`` change and answer, as Ollama 0.12 does
(``server/routes.go``: ``PullHandler``, ``CopyHandler``, ``DeleteHandler``, ``waitForStream``;
``server/create.go``: ``CreateHandler``; ``server/images.go``: ``PullModel``, ``CopyModel``;
``server/download.go``: ``downloadBlob``; ``server/layer.go``; ``types/model/name.go``).

State, no I/O: the stand-in's HTTP handler streams what this module yields. A model is a
manifest of layers, as on Ollama's disk: its weights (a blob whose digest depends on the
stand-in's ``copy`` and the model's name), a template and a config layer; a model made here by
``create`` adds ``system``, ``params``, ``license`` and ``messages`` layers. ``/api/tags``'s
digest is the sha256 of the manifest (Ollama's ``Manifest.digest``), its size the sum of the
layers, so a copy lists the same digest as its source and a created model another.

The disk is counted: blobs referenced by a served model's manifest are on it, and so are blobs
a failed pull left behind; ``disk_free_bytes`` (None: unlimited) goes down as a pull downloads
blobs and up as a delete drops the blobs nothing else references. Ollama checks no free space
before a pull: a blob whose download would overrun it fails as Ollama's write does
(``write <blob>-partial: no space left on device``), after the progress up to the free bytes.

Where the stand-in differs from Ollama, on purpose:

- ``create`` from a ``from`` model Ollama cannot pull: Ollama's handler sends the error and
  goes on (a client has stopped reading by then; the model it would write has no weights); the
  stand-in ends the stream at the error and writes nothing.
- No blob uploads (``/api/blobs``): ``files`` and ``adapters`` fail as Ollama fails for blobs it
  does not have. ``template`` is not parsed. Parameters are listed in name order (Go's map
  order is random).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from devtools.fakes.ollama import (
    _MODIFIED_AT,
    FakeOllama,
    _ApiError,
    _details,
    _field,
    _go_quote,
    _Msg,
    _normalize,
    _now,
    _size,
)

__all__ = ["MODELS_DIR", "ModelShelf", "Progress"]

MODELS_DIR = "/root/.ollama/models"  # OLLAMA_MODELS's default for root ($HOME/.ollama/models)

_MODEL = "application/vnd.ollama.image.model"
_TEMPLATE = "application/vnd.ollama.image.template"
_SYSTEM = "application/vnd.ollama.image.system"
_PARAMS = "application/vnd.ollama.image.params"
_LICENSE = "application/vnd.ollama.image.license"
_MESSAGES = "application/vnd.ollama.image.messages"
_CONFIG = "application/vnd.docker.container.image.v1+json"
_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"

# The template layer of every stand-in model (what /api/show's template is made of is the
# handler's: it follows the model's capabilities).
_STOCK_TEMPLATE = "{{ .Prompt }}"
_PROGRESS_STEPS = 4  # progress lines per downloaded blob, after its first (nothing yet)
_MISSING = "!MISSING!"  # Go's model.MissingPart: an empty part makes a name invalid
# What ggml.ParseFileType takes, and the types its error lists.
_QUANTIZATIONS = ("F32", "F16", "Q8_0", "Q4_K_S", "Q4_K_M", "Q4_K", "BF16")
_QUANTIZATIONS_LISTED = ("F32", "F16", "Q4_K_S", "Q4_K_M", "Q8_0")
_CAPABILITY_LISTS = (
    "thinking_models",
    "tool_models",
    "vision_models",
    "embedding_models",
    "insert_models",
)
_DIGEST = re.compile(r"sha256[:-][0-9a-fA-F]{64}")  # GetBlobsPath's check


# --------------------------------------------------------------------------- names


@dataclass(frozen=True)
class _Name:
    """A model name as Ollama's ``model.ParseName`` reads it (defaults merged)."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> _Name:
        def cut(s: str, sep: str) -> tuple[str, str, bool]:  # Go's cutPromised
            before, found, after = s.rpartition(sep)
            if not found:
                return s, "", False
            return before or _MISSING, after or _MISSING, True

        host = namespace = tag = ""
        rest = text
        if rest.rfind(":") > rest.rfind("/"):
            rest, tag, _ = cut(rest, ":")
        rest, model, promised = cut(rest, "/")
        if not promised:
            model = rest
        else:
            rest, namespace, promised = cut(rest, "/")
            if not promised:
                namespace = rest
            else:
                host = rest.split("://", 1)[-1]
        return cls(host or "registry.ollama.ai", namespace or "library", model, tag or "latest")

    @property
    def valid(self) -> bool:
        """Go's ``Name.IsValid``: every part of its kind's characters and length."""
        return all(
            _valid_part(kind, part)
            for kind, part in zip(
                ("host", "namespace", "model", "tag"),
                (self.host, self.namespace, self.model, self.tag),
                strict=True,
            )
        )

    @property
    def display(self) -> str:
        """Go's ``DisplayShortest``: how ``/api/tags`` names the model."""
        if self.host.lower() != "registry.ollama.ai":
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != "library":
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def key(self) -> str:
        """The stand-in's normalized name (`ollama._normalize`)."""
        return _normalize(self.display)


def _valid_part(kind: str, part: str) -> bool:
    if not 1 <= len(part) <= (350 if kind == "host" else 80):
        return False
    if not (part[0].isascii() and (part[0].isalnum() or part[0] == "_")):
        return False
    allowed = {"_", "-"} | ({"."} if kind != "namespace" else set())
    allowed |= {":"} if kind == "host" else set()
    return all((c.isascii() and c.isalnum()) or c in allowed for c in part[1:])


def _valid_path(path: str) -> bool:
    """Go's ``fs.ValidPath``: relative, slash-separated, no empty, ``.`` or ``..`` element."""
    return path == "." or all(part not in ("", ".", "..") for part in path.split("/"))


def blob_path(digest: str) -> str:
    """Where Ollama keeps a blob (``GetBlobsPath``)."""
    return f"{MODELS_DIR}/blobs/{digest.replace(':', '-')}"


# --------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class _Layer:
    media_type: str
    digest: str  # sha256:<64 hex>
    size: int
    source: str = ""  # the "from" of a layer taken from another model

    def wire(self) -> dict[str, Any]:
        layer: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.source:
            layer["from"] = self.source
        return layer


def _blob(media_type: str, data: bytes) -> _Layer:
    return _Layer(media_type, f"sha256:{hashlib.sha256(data).hexdigest()}", len(data))


def _go_encoded(value: object, *, sort_keys: bool = False) -> bytes:
    """What Go's ``json.NewEncoder(w).Encode`` writes: compact, ``<>&`` escaped, a newline."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)
    return text.encode() + b"\n"


def _config(details: dict[str, Any], layers: Sequence[_Layer]) -> _Layer:
    """The config blob (``ConfigV2``): what ``/api/tags`` reads a model's details from."""
    config = {
        "model_format": details["format"],
        "model_family": details["family"],
        "model_families": details["families"],
        "model_type": details["parameter_size"],
        "file_type": details["quantization_level"],
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
    }
    return _blob(_CONFIG, _go_encoded(config))


@dataclass(frozen=True)
class _Manifest:
    config: _Layer
    layers: tuple[_Layer, ...]

    @property
    def blobs(self) -> tuple[_Layer, ...]:
        """Its layers, then its config: the order Ollama downloads them in."""
        return (*self.layers, self.config)

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.blobs)

    @property
    def digest(self) -> str:
        """The sha256 of the manifest file as Ollama writes it (``WriteManifest``)."""
        manifest = {
            "schemaVersion": 2,
            "mediaType": _MANIFEST,
            "config": self.config.wire(),
            "layers": [layer.wire() for layer in self.layers],
        }
        return hashlib.sha256(_go_encoded(manifest)).hexdigest()

    def weights(self) -> _Layer:
        return next(layer for layer in self.layers if layer.media_type == _MODEL)


def _registry_manifest(key: str, copy: str) -> _Manifest:
    """The manifest of a stand-in model (as served, and as the registry gives it): its
    weights' blob named by ``copy`` and the name, sized so that the model is ``_size`` big."""
    details = _details(key)
    weights = _Layer(_MODEL, f"sha256:{hashlib.sha256(f'{copy}{key}'.encode()).hexdigest()}", 0)
    template = _blob(_TEMPLATE, _STOCK_TEMPLATE.encode())
    config = _config(details, (weights, template))
    weights = dataclasses.replace(weights, size=_size(key) - template.size - config.size)
    return _Manifest(config, (weights, template))


@dataclass(frozen=True)
class _Model:
    """A model as pulled, created or copied here: its manifest and what its layers say."""

    manifest: _Manifest
    weights: str  # the stand-in model (normalized) whose weights it has: sizes, details
    modified_at: str
    parent: str = ""  # /api/show's details.parent_model: the model it was created from
    template: str | None = None  # None: the stand-in's own (which follows the capabilities)
    system: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] = ()
    licenses: tuple[str, ...] = ()


# --------------------------------------------------------------------------- progress


@dataclass(frozen=True)
class Progress:
    """A pull's or a create's answer: its progress objects (``{"status": ...}``; an error is
    ``{"error": ...}``, with the HTTP ``status`` Ollama would give it when not streamed, the
    last object), streamed as NDJSON unless ``stream`` is False."""

    stream: bool
    events: Iterator[dict[str, Any]]


def _error(message: str, status: int | None = None) -> dict[str, Any]:
    # gin.H{"error": ..., "status": ...}: Go marshals a map's keys in order.
    return {"error": message} if status is None else {"error": message, "status": status}


def _pulling(layer: _Layer, completed: int) -> dict[str, Any]:
    """``api.ProgressResponse`` of a blob (``omitempty``: no ``completed`` while it is 0)."""
    event: dict[str, Any] = {
        "status": f"pulling {layer.digest[7:19]}",
        "digest": layer.digest,
        "total": layer.size,
    }
    if completed:
        event["completed"] = completed
    return event


def _go_float(value: float) -> str:
    """A float64 as Go's ``%v`` prints it: the shortest digits, in ``%e`` form when the
    exponent is below -4 or 6 and more (``strconv.FormatFloat(v, 'g', -1, 64)``: 1e+06)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    point = len(text) + exponent  # digits before the decimal point
    minus = "-" if sign else ""
    if point - 1 < -4 or point - 1 >= 6:
        mantissa = text[0] + (f".{text[1:]}" if len(text) > 1 else "")
        return f"{minus}{mantissa}e{point - 1:+03d}"
    if point <= 0:
        return f"{minus}0.{'0' * -point}{text}"
    if point >= len(text):
        return f"{minus}{text}{'0' * (point - len(text))}"
    return f"{minus}{text[:point]}.{text[point:]}"


def _go_value(value: object, *, quoted: bool = False) -> str:
    """A parameter's value as Go prints it once JSON gave it (numbers are float64s):
    ``%v``, or ``%#v`` (``quoted``), which quotes strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _go_float(float(value))
    if isinstance(value, str):
        return _go_quote(value) if quoted else value
    return json.dumps(value, ensure_ascii=False)


def _modelfile_quote(text: str) -> str:
    """The Modelfile parser's ``quote``."""
    if "\n" in text or text.startswith(" ") or text.endswith(" "):
        return f'"""{text}"""' if '"' in text else f'"{text}"'
    return text


def _items(parameters: dict[str, Any]) -> Iterator[tuple[str, object]]:
    for name in sorted(parameters):
        value = parameters[name]
        for item in value if isinstance(value, list) else [value]:
            yield name, item


def _licenses(value: object) -> tuple[str, ...]:
    """``CreateRequest.license`` as ``createModel`` takes it: a string, or a list of strings
    (JSON re-read as ``[]string``, whose errors are Go's); ValueError with Go's message."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    kinds = {bool: "bool", int: "number", float: "number", dict: "object", str: "string"}
    if not isinstance(value, list):
        raise ValueError(
            f"json: cannot unmarshal {kinds.get(type(value), 'array')} "
            "into Go value of type []string"
        )
    for item in value:
        if item is not None and not isinstance(item, str):
            kind = kinds.get(type(item), "array")
            raise ValueError(f"json: cannot unmarshal {kind} into Go value of type string")
    return tuple(item or "" for item in value)


# --------------------------------------------------------------------------- the shelf


class ModelShelf:
    """The models a `FakeOllama` holds beyond its knobs' defaults, and the answers of
    Ollama's model-management endpoints.

    The served set stays the fake's ``models`` knob (what ``/api/tags`` lists); a pull, a
    create or a copy puts its model first (Ollama lists the newest first) and a delete takes
    it out, each under this shelf's lock, so concurrent requests do not lose each other's
    models. A created or copied model is added to the capability lists its source is in.
    """

    def __init__(self, fake: FakeOllama) -> None:
        self._fake = fake
        self._lock = threading.RLock()
        self._made: dict[str, _Model] = {}  # normalized name -> model pulled or made here
        self._strays: dict[str, int] = {}  # blobs a failed pull left on disk: digest -> size

    def clear(self) -> None:
        """Forget every model pulled, created or copied (the fake's reset)."""
        with self._lock:
            self._made.clear()
            self._strays.clear()

    # ---------------------------------------------------------------- what the fake asks

    def weights(self, key: str) -> str:
        """The stand-in model whose weights the served model ``key`` has (itself, unless it
        was created or copied here): its size, details and embedding length follow them."""
        made = self._made.get(key)
        return key if made is None else made.weights

    def entry(self, name: str) -> dict[str, Any]:
        """``/api/tags``'s entry for the served model ``name``."""
        model = self._model(_normalize(name))
        return {
            "name": name,
            "model": name,
            "modified_at": model.modified_at,
            "size": model.manifest.size,
            "digest": model.manifest.digest,
            "details": _details(model.weights),
        }

    def shown(self, key: str, reply: dict[str, Any]) -> dict[str, Any]:
        """``/api/show``'s reply as the handler made it for the served model ``key``, with
        what the model's layers say (``GetModelInfo``): its Modelfile, parameters, system
        prompt, messages, licence, the model it was created from; in Ollama's field order."""
        model = self._model(key)
        template = reply["template"] if model.template is None else model.template
        shown: dict[str, Any] = {
            "license": "\n".join(model.licenses),
            "modelfile": self._modelfile(key, model, template),
            "parameters": "\n".join(
                f"{name:<30} {_go_value(value, quoted=True)}"
                for name, value in _items(model.parameters)
            ),
            "template": template,
        }
        if model.system:
            shown["system"] = model.system
        shown["details"] = reply["details"] | {"parent_model": model.parent}
        if model.messages:
            shown["messages"] = [dict(message) for message in model.messages]
        shown |= {k: v for k, v in reply.items() if k not in shown and k not in ("modified_at",)}
        shown["modified_at"] = model.modified_at
        return shown

    def chat_messages(self, name: str, messages: list[_Msg]) -> list[_Msg]:
        """The messages a chat with ``name`` runs on (``ChatHandler``): the model's own
        messages first, its system prompt before them unless the chat opens with one."""
        made = self._made.get(_normalize(name)) if name else None
        if made is None or not messages:
            return messages
        preamble = [_Msg(role=m["role"], content=m["content"], group=-1) for m in made.messages]
        if made.system and messages[0].role != "system":
            preamble.insert(0, _Msg(role="system", content=made.system, group=-1))
        return [*preamble, *messages]

    def system(self, name: str) -> str:
        """The model's system prompt, which a generate without a ``system`` of its own uses."""
        made = self._made.get(_normalize(name)) if name else None
        return "" if made is None else made.system

    def options(self, name: str, options: dict[str, Any]) -> dict[str, Any]:
        """The request's options over the model's parameters (its defaults)."""
        made = self._made.get(_normalize(name)) if name else None
        return options if made is None else made.parameters | options

    # ---------------------------------------------------------------- the endpoints

    def answer(self, api: str, body: dict[str, Any]) -> Progress | None:
        """Answer ``/api/<api>``: a `Progress` for ``pull`` and ``create``; None for ``copy``
        and ``delete``, done by then (HTTP 200, no body). A request refused before anything
        runs raises the stand-in's API error (Ollama's status and message)."""
        if api == "pull":
            return self._pull(body)
        if api == "create":
            return self._create(body)
        if api == "copy":
            self._copy(body)
        elif api == "delete":
            self._delete(body)
        else:
            raise ValueError(f"not a model-management API: {api!r}")
        return None

    def _pull(self, body: dict[str, Any]) -> Progress:
        struct = "PullRequest"
        for text_field in ("username", "password"):  # deprecated, ignored, still decoded
            _field(body, text_field, str, struct)
        _field(body, "insecure", bool, struct)  # deprecated: ignored
        stream: bool | None = _field(body, "stream", bool, struct)
        given: str = _field(body, "model", str, struct) or _field(body, "name", str, struct) or ""
        name = _Name.parse(given)
        if not name.valid:
            raise _ApiError(400, "invalid model name")
        return Progress(stream is not False, self._pull_steps(name))

    def _pull_steps(self, name: _Name) -> Generator[dict[str, Any], None, bool]:
        """``PullModel``: the manifest, each blob (at once when on disk), the check, the
        manifest written. True once pulled."""
        fake = self._fake
        yield {"status": "pulling manifest"}
        key = name.key
        if key not in {_normalize(entry) for entry in list(fake.registry)}:
            yield _error("pull model manifest: file does not exist")
            return False
        manifest = _registry_manifest(key, fake.copy)
        for layer in manifest.blobs:
            if self._on_disk(layer.digest):
                yield _pulling(layer, layer.size)
                continue
            sent = -1
            for step in range(_PROGRESS_STEPS + 1):
                completed = layer.size * step // _PROGRESS_STEPS
                free = fake.disk_free_bytes
                if free is not None and completed > free:
                    if free > sent:
                        yield _pulling(layer, free)
                    partial = f"{blob_path(layer.digest)}-partial"
                    yield _error(f"write {partial}: no space left on device")
                    return False
                yield _pulling(layer, completed)
                sent = completed
            self._downloaded(layer)
        yield {"status": "verifying sha256 digest"}
        yield {"status": "writing manifest"}
        model = _Model(manifest, weights=key, modified_at=_now())
        if self._commit(name, model, source=None, prune=True):
            yield {"status": "removing unused layers"}
        yield {"status": "success"}
        return True

    def _create(self, body: dict[str, Any]) -> Progress:
        struct = "CreateRequest"
        strings = {
            key: _field(body, key, str, struct) or ""
            for key in ("model", "name", "from", "template", "system", "quantize", "quantization")
        }
        blobs = {key: self._files(body, key) for key in ("files", "adapters")}
        parameters: dict[str, Any] = (
            _field(body, "parameters", dict, struct, "map[string]interface {}") or {}
        )
        messages = self._messages(body)
        stream: bool | None = _field(body, "stream", bool, struct)
        for path in blobs["files"] or {}:
            if not _valid_path(path):
                raise _ApiError(400, "file path must be relative")
        name = _Name.parse(strings["model"] or strings["name"])
        if not name.valid:
            raise _ApiError(400, "invalid model name")
        steps = self._create_steps(
            name,
            strings,
            blobs,
            parameters=parameters,
            messages=messages,
            license=body.get("license"),
        )
        return Progress(stream is not False, steps)

    def _create_steps(
        self,
        name: _Name,
        strings: dict[str, str],
        blobs: dict[str, dict[str, str] | None],
        *,
        parameters: dict[str, Any],
        messages: tuple[dict[str, str], ...],
        license: object,
    ) -> Iterator[dict[str, Any]]:
        """``CreateHandler`` with ``createModel``: the base model's layers (pulled first if
        need be), the new ones, the manifest."""
        if not strings["from"]:
            if blobs["files"] is not None:
                yield from _missing_blobs(blobs["files"], adapter=False)
            else:
                yield _error("neither 'from' or 'files' was specified", 400)
            return
        source = _Name.parse(strings["from"])
        if not source.valid:
            yield _error("invalid model name", 400)
            return
        if self._fake._find(source.key) is None and not (yield from self._pull_steps(source)):
            return  # Ollama goes on past the error: see the module's docstring
        if blobs["adapters"] is not None:
            yield from _missing_blobs(blobs["adapters"], adapter=True)
            return
        base = self._model(source.key)
        quantize = (strings["quantize"] or strings["quantization"]).upper()
        if quantize:
            if quantize not in _QUANTIZATIONS:
                yield _error(
                    f"unsupported quantization type {quantize} - supported types are "
                    + ", ".join(_QUANTIZATIONS_LISTED)
                )
            else:  # every stand-in model is Q4_K_M
                yield _error("quantization is only supported for F16 and F32 models")
            return
        try:
            licenses = _licenses(license)
        except ValueError as exc:
            yield _error(str(exc))
            return
        yield from self._write(
            name,
            source,
            base,
            strings=strings,
            parameters=parameters,
            messages=messages,
            licenses=licenses,
        )

    def _write(
        self,
        name: _Name,
        source: _Name,
        base: _Model,
        *,
        strings: dict[str, str],
        parameters: dict[str, Any],
        messages: tuple[dict[str, str], ...],
        licenses: tuple[str, ...],
    ) -> Iterator[dict[str, Any]]:
        """``createModel``'s layers: the base's (``using existing layer``), then each one set
        anew (``creating new layer`` unless its blob is on disk), the config, the manifest."""
        layers = [
            dataclasses.replace(layer, source=source.display) for layer in base.manifest.layers
        ]
        kept = [(layer, f"using existing layer {layer.digest}") for layer in layers]
        merged = base.parameters | parameters
        new: list[tuple[str, bytes]] = []
        if strings["template"]:
            new.append((_TEMPLATE, strings["template"].encode()))
        if strings["system"]:
            new.append((_SYSTEM, strings["system"].encode()))
        new += [(_LICENSE, text.encode()) for text in licenses]
        if merged:
            new.append((_PARAMS, _go_encoded(merged, sort_keys=True)))
        if messages:
            new.append((_MESSAGES, _go_encoded([dict(m) for m in messages])))
        replaced = {media for media, _ in new if media != _LICENSE}
        kept = [(layer, status) for layer, status in kept if layer.media_type not in replaced]
        written: set[str] = set()  # NewLayer writes each blob as it makes it
        for media, data in new:
            layer = _blob(media, data)
            on_disk = layer.digest in written or self._on_disk(layer.digest)
            written.add(layer.digest)
            state = "using existing" if on_disk else "creating new"
            kept.append((layer, f"{state} layer {layer.digest}"))
        for _, status in kept:
            yield {"status": status}
        final = tuple(layer for layer, _ in kept)
        manifest = _Manifest(_config(_details(base.weights), final), final)
        yield {"status": "writing manifest"}
        model = _Model(
            manifest,
            weights=base.weights,
            modified_at=_now(),
            parent=source.display,
            template=strings["template"] or base.template,
            system=strings["system"] or base.system,
            parameters=merged,
            messages=messages or base.messages,
            licenses=base.licenses + licenses,
        )
        self._commit(name, model, source=source.key, prune=True)
        yield {"status": "success"}

    def _copy(self, body: dict[str, Any]) -> None:
        """``CopyHandler``: the destination gets the source's manifest (a no-op onto itself)."""
        given = {
            key: _field(body, key, str, "CopyRequest") or "" for key in ("source", "destination")
        }
        source, destination = (_Name.parse(given[key]) for key in ("source", "destination"))
        for key, name in (("source", source), ("destination", destination)):
            if not name.valid:
                raise _ApiError(400, f"{key} {_go_quote(given[key])} is invalid")
        if source == destination:
            return
        with self._lock:
            if self._fake._find(source.key) is None:
                raise _ApiError(404, f"model {_go_quote(given['source'])} not found")
            model = dataclasses.replace(self._model(source.key), modified_at=_now())
            self._commit(destination, model, source=source.key, prune=False)

    def _delete(self, body: dict[str, Any]) -> None:
        """``DeleteHandler``: the manifest goes, and the blobs no other model references."""
        struct = "DeleteRequest"
        given: str = _field(body, "model", str, struct) or _field(body, "name", str, struct) or ""
        name = _Name.parse(given)
        if not name.valid:
            raise _ApiError(400, f"name {_go_quote(given)} is invalid")
        fake = self._fake
        with self._lock:
            if fake._find(name.key) is None:
                raise _ApiError(404, f"model '{given}' not found")
            before = self._disk()
            fake.models = [m for m in list(fake.models) if _normalize(m) != name.key]
            self._made.pop(name.key, None)
            self._settle(before, prune=True)

    # ---------------------------------------------------------------- state

    def _model(self, key: str) -> _Model:
        made = self._made.get(key)
        if made is not None:
            return made
        manifest = _registry_manifest(key, self._fake.copy)
        return _Model(manifest, weights=key, modified_at=_MODIFIED_AT)

    def _disk(self) -> dict[str, int]:
        """The blobs on disk: those of every served model's manifest, and strays."""
        blobs = dict(self._strays)
        for served in list(self._fake.models):
            for layer in self._model(_normalize(served)).manifest.blobs:
                blobs[layer.digest] = layer.size
        return blobs

    def _on_disk(self, digest: str) -> bool:
        with self._lock:
            return digest in self._disk()

    def _downloaded(self, layer: _Layer) -> None:
        """A pull's blob is on disk (a stray until its manifest is written)."""
        fake = self._fake
        with self._lock:
            if layer.digest in self._disk():
                return  # another pull brought it meanwhile
            self._strays[layer.digest] = layer.size
            if fake.disk_free_bytes is not None:
                fake.disk_free_bytes = max(0, fake.disk_free_bytes - layer.size)

    def _settle(self, before: dict[str, int], *, prune: bool) -> None:
        """The blobs that were on disk ``before`` and no manifest references now: removed
        (``prune``: their space given back, as Ollama's delete, pull and create do) or left
        as strays (a copy over a model leaves its old blobs, as Ollama's does)."""
        fake = self._fake
        after = self._disk()
        gone = {digest: size for digest, size in before.items() if digest not in after}
        if not prune:
            self._strays |= gone
        elif fake.disk_free_bytes is not None:
            fake.disk_free_bytes += sum(gone.values())

    def _commit(self, name: _Name, model: _Model, *, source: str | None, prune: bool) -> bool:
        """Serve ``model`` as ``name``, first in the list (with the case of a model already
        served under it), and in the capability lists of the model ``source``; True if the
        manifest it replaces had layers it has not."""
        fake = self._fake
        key = name.key
        with self._lock:
            before = self._disk()
            served = fake._find(key) is not None
            display = fake._served_name(key) if served else name.display
            replaced = (
                {layer.digest for layer in self._model(key).manifest.blobs} if served else set()
            )
            self._made[key] = model
            kept = {layer.digest for layer in model.manifest.blobs}
            for digest in kept:
                self._strays.pop(digest, None)
            fake.models = [display, *(m for m in list(fake.models) if _normalize(m) != key)]
            for knob in _CAPABILITY_LISTS if source is not None else ():
                listed: list[str] = list(getattr(fake, knob))
                names = {_normalize(entry) for entry in listed}
                if source in names and key not in names:
                    setattr(fake, knob, [*listed, display])
            self._settle(before, prune=prune)
            return bool(replaced - kept)

    # ---------------------------------------------------------------- request fields

    @staticmethod
    def _files(body: dict[str, Any], key: str) -> dict[str, str] | None:
        value: dict[str, Any] | None = _field(body, key, dict, "CreateRequest", "map[string]string")
        for item in (value or {}).values():
            if not isinstance(item, str):
                _field({key: item}, key, str, "CreateRequest")
        return value

    @staticmethod
    def _messages(body: dict[str, Any]) -> tuple[dict[str, str], ...]:
        struct = "CreateRequest"
        raw: list[Any] = _field(body, "messages", list, struct, "[]api.Message") or []
        messages = []
        for item in raw:
            if not isinstance(item, dict):
                _field({"messages": item}, "messages", dict, struct, "api.Message")
            texts = {
                key: _field(item, key, str, struct, path=f"messages.{key}") or ""
                for key in ("role", "content")
            }
            messages.append({"role": texts["role"].lower(), "content": texts["content"]})
        return tuple(messages)

    def _modelfile(self, key: str, model: _Model, template: str) -> str:
        """``/api/show``'s ``modelfile`` (``Model.String`` under its header)."""
        lines = [
            '# Modelfile generated by "ollama show"',
            "# To build a new Modelfile based on this, replace FROM with:",
            f"# FROM {_Name.parse(self._fake._served_name(key)).display}",
            "",
            f"FROM {blob_path(model.manifest.weights().digest)}",
            f"TEMPLATE {_modelfile_quote(template)}",
        ]
        if model.system:
            lines.append(f"SYSTEM {_modelfile_quote(model.system)}")
        lines += [
            f"PARAMETER {n} {_modelfile_quote(_go_value(v))}" for n, v in _items(model.parameters)
        ]
        lines += [f"LICENSE {_modelfile_quote(text)}" for text in model.licenses]
        lines += [f"MESSAGE {m['role']} {_modelfile_quote(m['content'])}" for m in model.messages]
        return "\n".join(lines) + "\n"


def _missing_blobs(files: dict[str, str], *, adapter: bool) -> Iterator[dict[str, Any]]:
    """``convertModelFromFiles`` over blobs the stand-in does not have (it takes no uploads):
    what Ollama sends then; every adapter error with status 400, as its handler gives them.
    The kind is the first file's (Go's map order is random)."""
    status = 400 if adapter else None
    first = next(iter(files), "")
    if first.endswith(".gguf"):
        if adapter and len(files) > 1:
            yield _error("only one adapter is currently supported", 400)
            return
        yield {"status": "parsing GGUF"}  # ggufLayers, for the first file
        digest = files[first]
        if not _DIGEST.fullmatch(digest):
            yield _error("invalid digest format", status)
        else:
            yield _error(f"open {blob_path(digest)}: no such file or directory", status)
    elif first.endswith(".safetensors"):
        if not all(_DIGEST.fullmatch(digest) for digest in files.values()):
            yield _error("invalid digest format", status)
            return
        # The blobs are linked into a directory whose config the converter cannot read.
        yield {"status": "converting adapter" if adapter else "converting model"}
        wanted = "adapter_config.json" if adapter else "config.json"
        yield _error(f"open {wanted}: no such file or directory", status)
    else:
        yield _error("unknown type", 400)  # nor a blob the stand-in has
