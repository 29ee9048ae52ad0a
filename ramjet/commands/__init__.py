"""One module per `ramjet` subcommand; each defines `register(subparsers)`."""
