"""What kvxfer's SGLang backend writes into failure reasons, shared by :mod:`.conn` (which writes it) and
the package's ``register`` hook (which reads it), so that :mod:`.conn` needs nothing from the package's
``__init__``: the package imports :mod:`.conn` lazily, and neither imports the other back."""

ADMISSION_REFUSED = "[kvxfer: refused at admission]"  # leads every failure reason of that kind
# leads the failure reason of a request whose prefill this decode does not trust (its keyring or
# KVXFER_TRUSTED_PREFILLS refused the address before opening anything): the client named it, so 403
UNTRUSTED_PREFILL = "[kvxfer: untrusted prefill]"
