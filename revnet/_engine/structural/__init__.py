"""The structural rules: constructs solved by more than one equation's rule.

One module a construct, each adding its structural rule to the registry and
its plan step's handler to the interpreter when imported: :mod:`.calls`
(nested calls and custom rules), :mod:`.scan` (``lax.scan``), :mod:`.select`
(``select_n`` with a known predicate), :mod:`.slices` (slices that cover a
value together) and :mod:`.shard_map` (``shard_map``). This package imports
none of them: ``revnet/_engine/__init__.py`` imports each by name
(``tests/engine/test_structure.py`` fails otherwise).
"""
