"""Audits of a deployment read from its logs, run before traffic or after an incident: each module owns one
check (``capacity``: KV-cache pool against advertised context), reads the logs it is given without trusting
them, changes nothing, and answers with a table, JSON and an exit status that a script can act on."""
