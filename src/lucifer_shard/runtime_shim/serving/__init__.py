"""`lucifer-shard doctor` and `serve`: the checks before a start, the vllm command, the launch scripts of
three boxes. Imports load/ and adapt/; only the CLI and register() import it."""
