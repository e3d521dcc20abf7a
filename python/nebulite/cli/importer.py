from typing import Any
def add_parser(sub: Any) -> None: pass
