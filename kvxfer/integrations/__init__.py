"""Adapters that make kvxfer a transfer backend of serving engines. Each imports its engine lazily:
importing :mod:`kvxfer` never imports one."""
