"""The core's second layer: what a policy means for one layout and topology. The engine
(:mod:`~kvpolicy.planning.engine`) decides each group's plan (:mod:`~kvpolicy.planning.plan`), the store
payload layout it runs under, the key contract routers read, what a prompt costs the store, and what a
policy edit changes. Imports only the language below it."""
