"""The checks of the source texts' claims, one module per source text (``seed000`` …
``seed004``), each function registered by claim id with `attnlab.textbook.core.check` (and the
exercises with `attnlab.textbook.exercises.exercise`) when imported. The claims' metadata is data:
``seed00N.toml`` beside the modules. `attnlab.textbook.all_claims` imports every module of this
package and joins them."""
