"""The JSON schema of `tokendyn doctor --json` (draft 2020-12), and its validation: with the ``jsonschema`` package
where it is installed, else a small validator of the subset the schema uses (type, required, enum, properties,
items, additionalProperties false, minItems / maxItems)."""

from __future__ import annotations

NUMBER_OR_NULL = {"type": ["number", "null"]}

FINDING = {
    "type": "object",
    "required": [
        "family",
        "name",
        "title",
        "status",
        "value",
        "interval",
        "unit",
        "reference",
        "verdict",
        "try",
        "reason",
        "details",
    ],  # fmt: skip
    "additionalProperties": False,
    "properties": {
        "family": {
            "enum": ["dominance", "bound", "sampler", "concentration", "remedies", "health", "spikes"]
        },
        "name": {"type": "string"},
        "title": {"type": "string"},
        "status": {"enum": ["measured", "not measured"]},
        "value": NUMBER_OR_NULL,
        "interval": {
            "type": ["array", "null"],
            "items": NUMBER_OR_NULL,
            "minItems": 2,
            "maxItems": 2,
        },
        "unit": {"type": "string"},
        "reference": {"type": "object"},
        "verdict": {"enum": ["fine", "watch", "act", None]},
        "try": {"type": ["string", "null"]},
        "reason": {"type": "string"},
        "details": {"type": "object"},
    },
}

RUN = {
    "type": "object",
    "required": ["run_dir", "method", "stack", "kinds", "counts", "findings"],
    "additionalProperties": False,
    "properties": {
        "run_dir": {"type": "string"},
        "method": {"type": "string"},
        "stack": {"enum": ["trl", "verl", "probe"]},
        "kinds": {"type": "array", "items": {"type": "string"}},
        "counts": {
            "type": "object",
            "required": ["fine", "watch", "act", "not measured"],
            "additionalProperties": False,
            "properties": {k: {"type": "integer"} for k in ("fine", "watch", "act", "not measured")},
        },
        "findings": {"type": "array", "items": FINDING},
    },
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tokendyn doctor",
    "type": "object",
    "required": ["version", "runs"],
    "additionalProperties": False,
    "properties": {"version": {"type": "string"}, "runs": {"type": "array", "items": RUN}},
}

TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def _is(value, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, TYPES[name])


def errors(doc, schema: dict = SCHEMA, path: str = "$") -> list[str]:
    """The hand validator: one line per place where ``doc`` breaks ``schema`` (empty: valid)."""
    out = []
    if "enum" in schema and doc not in schema["enum"]:
        return [f"{path}: {doc!r} not one of {schema['enum']}"]
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(doc, n) for n in names):
            return [f"{path}: {type(doc).__name__} is not {' or '.join(names)}"]
    if isinstance(doc, dict):
        for key in schema.get("required", ()):
            if key not in doc:
                out.append(f"{path}: missing {key!r}")
        props = schema.get("properties", {})
        for key, value in doc.items():
            if key in props:
                out += errors(value, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{path}: unexpected {key!r}")
    if isinstance(doc, list):
        if len(doc) < schema.get("minItems", 0) or len(doc) > schema.get("maxItems", len(doc)):
            out.append(f"{path}: {len(doc)} items")
        if "items" in schema:
            for i, item in enumerate(doc):
                out += errors(item, schema["items"], f"{path}[{i}]")
    return out


def validate(doc) -> None:
    """Raise ValueError naming the first place ``doc`` breaks `SCHEMA` (jsonschema when installed)."""
    try:
        import jsonschema
    except ImportError:
        found = errors(doc)
        if found:
            raise ValueError(f"doctor JSON: {found[0]}") from None
        return
    try:
        jsonschema.validate(doc, SCHEMA)
    except jsonschema.ValidationError as exc:
        where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        raise ValueError(f"doctor JSON: {where}: {exc.message}") from None
