"""How an output is checked (diff against the source, verify without it, the numerics), with
readers of its own so that it shares no reading code with what it proves; it imports formats/, model/,
source/ and output/, never engine/ or cli/."""
