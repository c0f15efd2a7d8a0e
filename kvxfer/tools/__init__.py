"""Tools built on the engines: the command line (:mod:`.cli`), the demo, the stress and chaos tool,
the benchmark, the deployment audits, the exposure simulator, the toy server, and the engine node
processes and child-process rules they share (:mod:`.node`, :mod:`.procs`, :mod:`.oracle`)."""
