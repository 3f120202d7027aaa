"""Wire protocols: each module maps one protocol's JSON to neutral types and back."""
