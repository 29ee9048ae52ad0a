"""The root of every exception `ramjet` raises on purpose, and its groups.

`except RamjetError` catches anything the router's own code raised as a decision (a
refused request, a bad policy file, a report that does not verify, an engine that
failed); anything else is a bug or the platform's. Each class keeps the built-in base
it had before the tree existed (`ValueError`, `OSError`), so existing `except` clauses
catch what they caught. The groups are new: nothing caught them before.

    RamjetError
    ├── ConfigError                        a policy file, or a file it names, is refused
    │   ├── PolicyFileError (ValueError)     ramjet.config: unreadable or invalid file
    │   ├── PolicyConfigError (ValueError)   ramjet.policy.registry: unknown policy, bad params
    │   ├── ReloadError (ValueError)         ramjet.app.reload: a reload refused, nothing changed
    │   ├── TokenizerFileError (ValueError)  ramjet.keys.tokens: tokenizer/template file
    │   └── KeyError_ (ValueError)           ramjet.reports.keys: a key file or key text
    ├── RequestError                       ramjet.request.parse: a client request refused
    ├── PromptError (ValueError)           ramjet.keys.prefix: messages/prompt not renderable
    ├── ReportError                        a signed report refused before it changes anything
    │   ├── EnvelopeError (ValueError)       ramjet.reports.envelope: frame, signature
    │   ├── BodyError (ValueError)           ramjet.reports.bodies: body schema
    │   ├── BatchError (ValueError)          ramjet.reports.transport: batch framing
    │   └── ResponseTooLarge                 ramjet.reports.ingest: a pull answer over the cap
    ├── ProxyError                         forwarding to an engine failed
    │   ├── UpstreamError                    ramjet.proxy.exchange: an attempt failed (`kind`)
    │   ├── UpstreamConnectError (OSError)   ramjet.transport.base: no connection
    │   └── UpstreamClosed (OSError)         ramjet.transport.base: closed, broken, not HTTP
    ├── RedisUnavailable                   ramjet.residency.redis_link: fail open to local state
    │   └── RedisCommandError                an error reply (OOM, script error): a failure
    ├── InvalidEntry (ValueError)          ramjet.residency.redis_ops: Redis data failing its checks
    ├── WireError (ValueError)             ramjet.sidecar.wire: an engine event not decodable
    │   └── UnknownEventType
    └── PromptTooLong (RuntimeError)       ramjet.sidecar.probe: a probe prompt over the context

A new public exception goes under the group it belongs to (or the root), and into this
drawing; `tests/ramjet/test_errors.py` imports every module and fails on one that is not
under `RamjetError`, or not drawn here.
"""

from __future__ import annotations


class RamjetError(Exception):
    """The root; see the module docstring."""


class ConfigError(RamjetError):
    """A policy file, or a file it names, is refused; nothing was applied."""


class ReportError(RamjetError):
    """A signed report (or its transport) refused before it changed anything."""


class ProxyError(RamjetError):
    """Forwarding a request to an engine failed."""
