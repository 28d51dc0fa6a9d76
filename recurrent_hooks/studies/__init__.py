"""The studies, built on the engine's reads and writes: `sweep/` (activation patching of every layer x position),
`attribution/` (attribution patching from one backward), `harvest/` (a dataset's values on disk, and its reader),
`effective_attention` (the public function; each kind has its maths), `probes`, `metrics`, `ranks` (the split across
processes) and `plots`. A study with parts is a package. A study imports the engine; the engine and the kinds import
no study.
"""
