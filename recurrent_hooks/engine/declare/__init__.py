"""What a mixer kind is written in: the declaration of its kernels as data (`kernels`: `Kernel`, `Role`, `Site`,
`Segments`, the memory names), what a kind cannot do as asked (`limits`: `Caveat`, `Refused`), a memory of several
named parts (`memory_parts`), what every kind's token loops share (`loops`: the per-token visitor contract,
`OnToken`, and the maths toolkit) and the effective-attention result the kinds build (`effective`). Nothing here runs
a call: the other folders read these declarations."""
