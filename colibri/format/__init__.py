"""The `.coli` file: its byte layout (layout.py), writer and reader (container.py), the checks every value passes
on open (validate.py), checksums (integrity.py) and `colibri inspect` (inspect.py). Spec: docs/FORMAT.md."""
