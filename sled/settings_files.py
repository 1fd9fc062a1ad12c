"""The settings file a command reads (`sled serve --config`, `sled device --config`): TOML or YAML
by its extension, checked before anything starts. Both sides' settings read it through here."""
from __future__ import annotations

from pathlib import Path

from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource,
                               YamlConfigSettingsSource)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names every bad key and where it came from."""


def settings_file(path: str | Path | None) -> Path | None:
    """The config file as a Path (None for none); a missing file or another format is refused."""
    if not path:
        return None
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"config file {path} does not exist")
    if path.suffix.lower() not in (".toml", ".yaml", ".yml"):
        raise SettingsError(f"config file {path}: use a .toml, .yaml or .yml file")
    return path


def file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    """The pydantic-settings source that reads `path` (checked by settings_file) into settings_cls."""
    if path.suffix.lower() == ".toml":
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    return YamlConfigSettingsSource(settings_cls, yaml_file=path)
