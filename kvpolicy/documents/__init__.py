"""The core's top layer: the documents kvpolicy reads and writes, as files. The loader reads and checks
every kind with located errors (:mod:`~kvpolicy.documents.loader`); the connector's settings
(:mod:`~kvpolicy.documents.settings`); the JSON Schemas of them all; plans and statuses written for
people and machines (:mod:`~kvpolicy.documents.report`); and a policy proposed from discovery reports
(:mod:`~kvpolicy.documents.propose`). The adapters, the simulation and the application build on it."""
