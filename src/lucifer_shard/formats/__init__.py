"""The formats every side reads and writes, below the model: the strict JSON reader and field specs, records
declared once, the one reader of untrusted safetensors headers, the dtypes and their sizes. Imports no room."""
