"""The checkpoint that is read: resolved on disk or on the Hugging Face Hub, its headers checked, its content
fingerprinted, its shards streamed in the order that keeps fewest on disk. Imports formats/ and model/."""
