"""Wire types for every subject family, as msgspec Structs (JSON on the wire)."""
