"""What the output must be, from the config alone (config, plan, rule table, layouts, footprint),
and the formats and protocols every side reads (manifest, safetensors headers, digests, source
checkpoint, OUT's lock); it imports nothing from engine/, proof/ or cli/."""
