"""feos.web: the web console feosd serves with --web (docs/console.md).

A small ASGI app (`ConsoleApp`) served by hypercorn's trio worker on feosd's own loop; it reaches
the services through one adapter (`Api`), which calls the API's own handlers.
"""

from ._api import CALLS as CALLS
from ._api import Api as Api
from ._app import ConsoleApp as ConsoleApp
from ._security import Guard as Guard
from ._security import is_loopback as is_loopback
from ._server import parse_web_address as parse_web_address
from ._server import serve_console as serve_console
