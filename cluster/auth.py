"""ZMQ CURVE keys of a cluster: make a key directory, and put its keys on a socket.

A key directory holds the router's key pair (``server.key``, ``server.key_secret``) and, in
``clients/``, one pair per client (``NAME.key``, ``NAME.key_secret``). With ``--auth-keys DIR``
the router encrypts its client socket and accepts only clients whose public key is in
``clients/``; a client needs its secret key and the router's public key (``--auth-keys DIR``
there too, or a copy of those two files laid out the same way).

    python -m pdserve.cluster.auth DIR [--client NAME]   # the router's pair (once) and a client's

The HTTP front end that ``launch.py --http-port`` starts, and ``launch.py --status``, connect
with the pair named ``client`` (``DEFAULT_CLIENT``), the one the command makes by default.
"""

from __future__ import annotations

from pathlib import Path

import click
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER = "server"
CLIENTS = "clients"
DEFAULT_CLIENT = "client"
# The --auth-client option of the client and the HTTP front end.
AUTH_CLIENT_HELP = (
    "Whose key pair of --auth-keys DIR to use (python -m pdserve.cluster.auth DIR --client NAME adds one)."
)


def generate_keys(directory: str | Path, client: str = DEFAULT_CLIENT) -> Path:
    """The router's key pair (unless the directory has one) and a new pair for ``client``."""
    root = Path(directory)
    (root / CLIENTS).mkdir(parents=True, exist_ok=True)
    if not (root / f"{SERVER}.key_secret").exists():
        zmq.auth.create_certificates(root, SERVER)
    if (root / CLIENTS / f"{client}.key_secret").exists():
        raise FileExistsError(f"{root / CLIENTS / client}.key_secret exists already")
    zmq.auth.create_certificates(root / CLIENTS, client)
    return root


def secure_server(socket: zmq.Socket, directory: str | Path) -> ThreadAuthenticator:
    """Make ``socket`` (before it binds) a CURVE server that admits the directory's clients only;
    the returned authenticator must be stopped when the socket closes."""
    server_secret, clients = _router_files(Path(directory))
    public, secret = zmq.auth.load_certificate(server_secret)
    authenticator = ThreadAuthenticator(socket.context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(clients))
    socket.curve_publickey, socket.curve_secretkey = public, secret
    socket.curve_server = True
    return authenticator


def secure_client(socket: zmq.Socket, directory: str | Path, client: str = DEFAULT_CLIENT) -> None:
    """Give ``socket`` (before it connects) the key pair of ``client`` and the router's public key."""
    server_key, client_secret = _client_files(Path(directory), client)
    server_public, _ = zmq.auth.load_certificate(server_key)
    public, secret = zmq.auth.load_certificate(client_secret)
    socket.curve_serverkey = server_public
    socket.curve_publickey, socket.curve_secretkey = public, secret


def check_router_keys(directory: str | Path) -> None:
    """FileNotFoundError, naming the command that makes the file, unless ``directory`` holds what
    the router needs (``secure_server``): checked before anything starts."""
    _router_files(Path(directory))


def check_client_keys(directory: str | Path, client: str = DEFAULT_CLIENT) -> None:
    """As ``check_router_keys``, for what ``client`` needs (``secure_client``)."""
    _client_files(Path(directory), client)


def _router_files(root: Path) -> tuple[Path, Path]:
    """The router's secret key (which holds its public one too) and the clients' key folder."""
    make = f"python -m pdserve.cluster.auth {root}"
    return _existing(root / f"{SERVER}.key_secret", make), _existing(root / CLIENTS, make)


def _client_files(root: Path, client: str) -> tuple[Path, Path]:
    """The router's public key and ``client``'s secret key (which holds its public one too)."""
    make = f"python -m pdserve.cluster.auth {root}"
    return _existing(root / f"{SERVER}.key", make), _existing(
        root / CLIENTS / f"{client}.key_secret", f"{make} --client {client}"
    )


def _existing(path: Path, make: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (make it with: {make})")
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--client",
    default=DEFAULT_CLIENT,
    show_default=True,
    help=f"Name of the client key pair to add (the HTTP front end of launch.py --http-port uses {DEFAULT_CLIENT!r}).",
)
def main(directory: str, client: str) -> None:
    """Create DIRECTORY's router keys (once) and a client key pair for --auth-keys."""
    try:
        root = generate_keys(directory, client)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"keys in {root}: router {SERVER}.key(_secret), client {CLIENTS}/{client}.key(_secret)")


if __name__ == "__main__":
    main(prog_name="python -m pdserve.cluster.auth")
