#!/usr/bin/env bash
# Installs the Tandem bundle for the current user (no root), or removes it again.
#
#   ./install-linux.sh                 install the bundle this script sits in (or installer/dist/tandem)
#   ./install-linux.sh --bundle DIR    install the bundle in DIR
#   ./install-linux.sh --uninstall     remove exactly what an install placed
#
# What it places (XDG base directories; $XDG_DATA_HOME defaults to ~/.local/share):
#   ~/.local/lib/tandem/                                   the bundle, and install-manifest.txt
#   $XDG_DATA_HOME/applications/tandem.desktop            the launcher (menus, docks, search)
#   $XDG_DATA_HOME/icons/hicolor/<N>x<N>/apps/tandem.png  the icon, 16…512 px, and scalable/apps/tandem.svg
#   ~/.local/bin/tandem                                    a link to the executable, only if that name is free
# The manifest lists every one of these; --uninstall removes those and nothing else. Chats, settings
# and the hardware profile live in the user data folder (~/.local/share/tandem), which neither
# install nor uninstall touches, so a reinstall keeps them.
set -euo pipefail

NAME=tandem
DATA_HOME="${XDG_DATA_HOME:-$HOME/.local/share}"
LIB_DIR="$HOME/.local/lib/$NAME"
BIN_LINK="$HOME/.local/bin/$NAME"
MANIFEST="$LIB_DIR/install-manifest.txt"
ICON_SIZES="16 32 48 64 128 256 512"

say() { printf '%s\n' "$*"; }
die() { printf 'error: %s\n' "$1" >&2; [ $# -lt 2 ] || printf 'what to do: %s\n' "$2" >&2; exit 2; }

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

refresh_caches() {  # menus and icon themes pick up changes without these on most desktops; harmless
    command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$DATA_HOME/applications" 2>/dev/null || true
    command -v gtk-update-icon-cache >/dev/null 2>&1 && [ -f "$DATA_HOME/icons/hicolor/index.theme" ] \
        && gtk-update-icon-cache -q -t "$DATA_HOME/icons/hicolor" 2>/dev/null || true
}

uninstall() {
    [ -f "$MANIFEST" ] || { say "Tandem is not installed for this user (no $MANIFEST)."; return 0; }
    while IFS= read -r path; do
        [ -n "$path" ] || continue
        if [ "$path" = "$BIN_LINK" ]; then
            # Only the link this script made: never a `tandem` another install (pip --user) put there.
            if [ -L "$path" ] && [ "$(readlink "$path")" = "$LIB_DIR/$NAME" ]; then rm -f "$path"; fi
        elif [ "$path" != "$LIB_DIR" ]; then
            rm -f "$path"
        fi
    done < "$MANIFEST"
    rm -rf "$LIB_DIR"  # the bundle: nothing but what the install copied there
    refresh_caches
    say "Removed Tandem. Your chats and settings are kept (in the user data folder)."
}

find_bundle() {
    local here
    here="$(cd "$(dirname "$0")" && pwd)"
    if [ -x "$here/$NAME" ] && [ -d "$here/_internal" ]; then echo "$here"   # the script inside a bundle
    elif [ -x "$here/dist/$NAME/$NAME" ]; then echo "$here/dist/$NAME"       # a source checkout's installer/
    else return 1; fi
}

install() {
    local bundle="$1" assets tmp
    bundle="$(cd "$bundle" && pwd)"
    [ -x "$bundle/$NAME" ] || die "$bundle has no executable '$NAME'" "build the bundle first: python installer/build.py"
    assets="$bundle/_internal/assets"
    [ -f "$assets/$NAME.desktop" ] && [ -f "$assets/$NAME.svg" ] || die "$bundle lacks its assets" "rebuild the bundle"
    case "$LIB_DIR" in *'"'*|*'`'*|*'$'*|*'\'*) die "the install path $LIB_DIR has characters a launcher cannot quote";; esac
    [ "$bundle" != "$LIB_DIR" ] || die "this bundle is the installed copy" "run the install from the unpacked download"

    [ ! -f "$MANIFEST" ] || uninstall >/dev/null  # a reinstall replaces the old files, user data stays

    mkdir -p "$(dirname "$LIB_DIR")"
    tmp="$LIB_DIR.partial"
    rm -rf "$tmp"
    cp -a "$bundle/." "$tmp/"
    mv "$tmp" "$LIB_DIR"  # a half-copied bundle never sits at the real path
    local placed=("$LIB_DIR")

    mkdir -p "$DATA_HOME/applications"
    local desktop="$DATA_HOME/applications/$NAME.desktop"
    sed -e "s|^Exec=.*|Exec=\"$LIB_DIR/$NAME\" gui|" -e "s|^TryExec=.*|TryExec=$LIB_DIR/$NAME|" \
        "$assets/$NAME.desktop" > "$desktop"
    chmod 644 "$desktop"
    placed+=("$desktop")

    local n dir
    for n in $ICON_SIZES; do
        [ -f "$assets/icons/$NAME-$n.png" ] || continue
        dir="$DATA_HOME/icons/hicolor/${n}x${n}/apps"
        mkdir -p "$dir"
        cp "$assets/icons/$NAME-$n.png" "$dir/$NAME.png"
        placed+=("$dir/$NAME.png")
    done
    dir="$DATA_HOME/icons/hicolor/scalable/apps"
    mkdir -p "$dir"
    cp "$assets/$NAME.svg" "$dir/$NAME.svg"
    placed+=("$dir/$NAME.svg")

    if [ ! -e "$BIN_LINK" ] && [ ! -L "$BIN_LINK" ]; then
        mkdir -p "$(dirname "$BIN_LINK")"
        ln -s "$LIB_DIR/$NAME" "$BIN_LINK"
        placed+=("$BIN_LINK")
    elif [ "$(readlink "$BIN_LINK" 2>/dev/null)" != "$LIB_DIR/$NAME" ]; then
        say "note: $BIN_LINK exists and is not this install's; left as it is (run $LIB_DIR/$NAME directly)."
    fi

    printf '%s\n' "${placed[@]}" > "$MANIFEST"
    refresh_caches
    say "Installed Tandem in $LIB_DIR."
    say "Start it from the applications menu, or run: $LIB_DIR/$NAME"
}

bundle=""
mode=install
while [ $# -gt 0 ]; do
    case "$1" in
        --uninstall) mode=uninstall ;;
        --bundle) [ $# -ge 2 ] || die "--bundle needs a folder"; bundle="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1'" "see --help" ;;
    esac
    shift
done

if [ "$mode" = uninstall ]; then
    uninstall
else
    [ -n "$bundle" ] || bundle="$(find_bundle)" || die "no bundle found next to this script" \
        "build one (python installer/build.py) or pass --bundle DIR"
    install "$bundle"
fi
