"""The output contract every reader and the writer share: the manifest and its typed records, a node's share,
the one output check, one writer per OUT and the read watch. Imports formats/, model/ and source/."""
