"""The `rlhf` commands, one module each: its subparser (`add_parser(sub)`, which sets the handler
as `func`) and its handler, in the order `rlhf --help` lists them."""

from . import config, eval, export, init_model, iterate, make_prefs, redis, serve, train, train_rm, up

COMMANDS = (config, init_model, train, eval, make_prefs, export, train_rm, iterate, serve, redis, up)
