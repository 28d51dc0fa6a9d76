"""Which forward a kernel call belongs to, and what runs it: the module tap and the dispatcher bound in place of
each kernel (`tap`: nothing wanted runs the bound kernel, a busy call its path), the per-thread stack of running
mixer forwards (`forwards`, its one owner pushing and popping) and the hook by which a study runs a mixer's idle
calls itself (`takeover`)."""
