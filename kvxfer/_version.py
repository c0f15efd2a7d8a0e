"""kvxfer's version, in a module of its own at the bottom of the package so that any layer (the CLI's
``--version``) can read it without importing the package front, :mod:`kvxfer`, which imports the engines."""

__version__ = "0.1.0"
