"""The core: page state and the rules that guard it, with no I/O.

The layout of KV memory (:mod:`.layout`, :mod:`.memory`, :mod:`.region`, :mod:`.gpu`), the page
ledger and pool (:mod:`.ledger`, :mod:`.pool`), request lifecycles (:mod:`.lifecycle`), the write guard
(:mod:`.writeguard`), completion verification (:mod:`.verify`, :mod:`.checksum`), write batches
(:mod:`.runs`), tags (:mod:`.tags`) and what callers may pass (:mod:`.arguments`). Everything above
(transports, engines, tools) builds on these; nothing here imports from those layers.
"""
