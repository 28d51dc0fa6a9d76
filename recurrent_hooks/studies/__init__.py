"""The studies, built on the engine's reads and writes: `sweep` (activation patching of every layer x position),
`attribution` (attribution patching from one backward), `effective_attention` (the public function; each kind
has its maths) and `plots`. A study imports the engine; the engine and the kinds import no study.
"""
