package core

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// The rules of a socket directory's path (socketdir.go says why it
// matters): every directory and symlink the path passes through, as named
// and where its symlinks lead, must belong to us or root, and no directory
// may be writable by anybody else unless it has the sticky bit (then only
// an entry's owner may rename or remove it, and the entries we pass
// through are ours or root's). Then nobody else can change where the path
// leads. With fs.protected_symlinks=1 (distributions' default) the kernel
// already refuses to follow another user's symlink in a sticky
// world-writable directory, with a bare EACCES; these rules hold whatever
// it is set to, cover the other ways, and say why.

// maxSymlinks is how many symlinks a path may pass through, as the kernel
// allows (ELOOP beyond).
const maxSymlinks = 40

// unsafePathError says which entry of a socket directory's path another
// uid could change, and what to do.
type unsafePathError struct{ msg string }

func (e *unsafePathError) Error() string { return e.msg }

// checkPath resolves the absolute path as the kernel would, one component
// at a time, and checks each directory and symlink it passes through
// (checkEntry). It returns the path of the directory it leads to, free of
// symlinks; an *unsafePathError when another uid could change where it
// leads; or the error of the component it could not read (wrapping
// ENOENT, ENOTDIR, EACCES, ELOOP).
func checkPath(path string) (string, error) {
	uid := uint32(os.Geteuid())
	var st unix.Stat_t
	if err := unix.Lstat("/", &st); err != nil {
		return "", &os.PathError{Op: "lstat", Path: "/", Err: err}
	}
	if err := checkEntry("/", &st, uid); err != nil {
		return "", err
	}
	real, rest, links := "/", strings.Split(path, "/"), 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..": // the kernel takes ".." where it stands, past any symlink
			real = filepath.Dir(real)
			continue
		}
		p := filepath.Join(real, c)
		if err := unix.Lstat(p, &st); err != nil {
			return "", &os.PathError{Op: "lstat", Path: p, Err: err}
		}
		if err := checkEntry(p, &st, uid); err != nil {
			return "", err
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			real = p
		case unix.S_IFLNK:
			if links++; links > maxSymlinks {
				return "", &os.PathError{Op: "resolve", Path: path, Err: unix.ELOOP}
			}
			target, err := os.Readlink(p)
			if err != nil {
				return "", err
			}
			if filepath.IsAbs(target) {
				real = "/"
			}
			rest = append(strings.Split(target, "/"), rest...)
		default:
			return "", &os.PathError{Op: "resolve", Path: p, Err: unix.ENOTDIR}
		}
	}
	return real, nil
}

// checkEntry refuses a directory or symlink of a socket directory's path
// that a uid other than ours and root's could change: one that belongs to
// such a uid (the owner of a directory may write it, the owner of a symlink
// may replace it even in a sticky directory), or a directory that others
// may write without the sticky bit.
func checkEntry(p string, st *unix.Stat_t, uid uint32) error {
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	switch {
	case st.Uid != uid && st.Uid != 0 && isDir:
		return &unsafePathError{fmt.Sprintf("%s belongs to uid %d, who could replace the exporter's socket; use a directory of uid %d (ours) or root", p, st.Uid, uid)}
	case st.Uid != uid && st.Uid != 0 && st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return &unsafePathError{fmt.Sprintf("%s is a symlink of uid %d, who could point it at a directory of theirs (the owner of a symlink may replace it, even in a sticky directory such as /tmp); use a path whose directories and symlinks belong to uid %d (ours) or root", p, st.Uid, uid)}
	case isDir && st.Mode&0o022 != 0 && st.Mode&unix.S_ISVTX == 0:
		return &unsafePathError{fmt.Sprintf("%s is writable by other users (mode %04o) and has no sticky bit, so any of them could replace the exporter's socket; use a directory only this user can write (chmod 0700), or set the sticky bit (chmod +t), as /tmp has", p, st.Mode&0o7777)}
	}
	return nil
}
