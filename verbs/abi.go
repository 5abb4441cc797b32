// Package verbs builds odpemu's libibverbs.so.1: a replacement for rdma-core's verbs
// library that unmodified verbs programs (ibv_devinfo, perftest, rdma-core's pyverbs
// tests) load through LD_LIBRARY_PATH, with one device, odpemu0, the emulated ODP NIC
// of package odp.
//
// The library has two halves. libibverbs.so.1 is C (libibverbs/verbs.c), compiled
// against the installed rdma-core headers, so that every structure a program or
// verbs.h's inline functions reach into has the installed layout. It exports exactly
// the (version, symbol) set of the installed library, read from it at build time
// (ReadABI): the programs and the provider libraries loaded beside them (libmlx5,
// libefa, librdmacm) are linked BIND_NOW, so every symbol they import must resolve,
// the private IBVERBS_PRIVATE_NN ones included; what verbs.c does not implement is a
// generated stub that fails with EOPNOTSUPP (NULL for a function returning a pointer).
// libodpemu-verbs.so is Go (package emu, built with -buildmode=c-shared): the
// emulator, loaded by the C half with dlopen when a program first opens a device.
//
// Build makes both; the command cmd/odpemu (odpemu run -- PROGRAM) runs it.
package verbs

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// ErrNoRDMACore is returned when the installed rdma-core (its libibverbs.so.1 and
// headers) or a C compiler, which the build needs, is missing.
var ErrNoRDMACore = errors.New("verbs: needs gcc and rdma-core's libibverbs.so.1 and headers (Debian: libibverbs-dev)")

// Symbol is a symbol a shared library exports at its default version.
type Symbol struct {
	Name, Version string
	Object        bool   // a data object, not a function
	Size          uint64 // an object's size (0 for a function)
}

// Version is a version node a library defines, with the node it inherits from.
type Version struct{ Name, Parent string }

// ABI is what a shared library exports: its version nodes in definition order (the
// base node, named after the soname, left out) and its default-version symbols.
// Hidden compatibility symbols (name@VERSION without a default) are not part of it.
type ABI struct {
	Versions []Version
	Symbols  []Symbol // sorted by version, then name
}

// ReadABI reads the ABI of the shared library at path.
func ReadABI(path string) (*ABI, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read only
	vers, err := f.DynamicVersions()
	if err != nil {
		return nil, fmt.Errorf("verbs: %s: version definitions: %w", path, err)
	}
	a := &ABI{}
	for _, v := range vers {
		if v.Flags&elf.VER_FLG_BASE != 0 {
			continue
		}
		var parent string
		if len(v.Deps) > 0 {
			parent = v.Deps[0]
		}
		a.Versions = append(a.Versions, Version{Name: v.Name, Parent: parent})
	}
	syms, err := f.DynamicSymbols()
	if err != nil {
		return nil, fmt.Errorf("verbs: %s: dynamic symbols: %w", path, err)
	}
	for _, s := range syms {
		if s.Section == elf.SHN_UNDEF || s.Section == elf.SHN_ABS || s.Version == "" || !s.HasVersion || s.VersionIndex.IsHidden() {
			continue
		}
		if b := elf.ST_BIND(s.Info); b != elf.STB_GLOBAL && b != elf.STB_WEAK {
			continue
		}
		t := elf.ST_TYPE(s.Info)
		if t != elf.STT_FUNC && t != elf.STT_OBJECT {
			continue
		}
		sym := Symbol{Name: s.Name, Version: s.Version, Object: t == elf.STT_OBJECT}
		if sym.Object {
			sym.Size = s.Size
		}
		a.Symbols = append(a.Symbols, sym)
	}
	sort.Slice(a.Symbols, func(i, j int) bool {
		if a.Symbols[i].Version != a.Symbols[j].Version {
			return a.Symbols[i].Version < a.Symbols[j].Version
		}
		return a.Symbols[i].Name < a.Symbols[j].Name
	})
	return a, nil
}

// VersionScript is the linker version script that gives a library this ABI's version
// nodes and exports its symbols at them, and nothing else.
func (a *ABI) VersionScript() []byte {
	byVersion := map[string][]string{}
	for _, s := range a.Symbols {
		byVersion[s.Version] = append(byVersion[s.Version], s.Name)
	}
	var b bytes.Buffer
	for i, v := range a.Versions {
		fmt.Fprintf(&b, "%s {\n", v.Name)
		if names := byVersion[v.Name]; len(names) > 0 {
			b.WriteString("\tglobal:\n")
			for _, n := range names {
				fmt.Fprintf(&b, "\t\t%s;\n", n)
			}
		}
		if i == 0 {
			b.WriteString("\tlocal: *;\n")
		}
		if v.Parent != "" {
			fmt.Fprintf(&b, "} %s;\n", v.Parent)
		} else {
			b.WriteString("};\n")
		}
	}
	return b.Bytes()
}

// returnKind is how a stub fails: as a function returning a pointer (NULL), an
// integer (an errno value), or nothing.
type returnKind int

const (
	returnsInt returnKind = iota
	returnsPointer
	returnsVoid
)

// prototypeKinds reads, from preprocessed C headers, how each of the named functions
// returns; names the headers do not declare are missing from the result.
func prototypeKinds(headers []byte, names []string) map[string]returnKind {
	kinds := map[string]returnKind{}
	for _, n := range names {
		re := regexp.MustCompile(`(?:^|[;{}])([^;{}()]*?)\b` + regexp.QuoteMeta(n) + `\s*\(`)
		for _, m := range re.FindAllSubmatch(headers, -1) {
			decl := string(m[1])
			if strings.Contains(decl, "inline") || strings.Contains(decl, "typedef") || strings.Contains(decl, "#") {
				continue
			}
			switch {
			case strings.Contains(decl, "*"):
				kinds[n] = returnsPointer
			case regexp.MustCompile(`\bvoid\s*$`).MatchString(decl):
				kinds[n] = returnsVoid
			default:
				kinds[n] = returnsInt
			}
			break
		}
	}
	return kinds
}

// Stubs is C source defining every symbol of the ABI that defined lacks: a function
// that sets errno to EOPNOTSUPP and fails as kinds says it returns (an errno value
// when kinds does not know it), or a zeroed object of the exported size.
func (a *ABI) Stubs(defined map[string]bool, kinds map[string]returnKind) []byte {
	var b bytes.Buffer
	b.WriteString("/* Generated by verbs.Build from the installed libibverbs.so.1: what verbs.c does not implement. */\n")
	b.WriteString("#include <errno.h>\n#include <stddef.h>\n#define EXPORT __attribute__((visibility(\"default\")))\n\n")
	for _, s := range a.Symbols {
		if defined[s.Name] {
			continue
		}
		switch {
		case s.Object:
			fmt.Fprintf(&b, "EXPORT unsigned char %s[%d];\n", s.Name, max(s.Size, 1))
		case kinds[s.Name] == returnsPointer:
			fmt.Fprintf(&b, "EXPORT void *%s(void) { errno = EOPNOTSUPP; return NULL; }\n", s.Name)
		case kinds[s.Name] == returnsVoid:
			fmt.Fprintf(&b, "EXPORT void %s(void) {}\n", s.Name)
		default:
			fmt.Fprintf(&b, "EXPORT int %s(void) { errno = EOPNOTSUPP; return EOPNOTSUPP; }\n", s.Name)
		}
	}
	return b.Bytes()
}

// SystemLibrary returns the path of the installed libibverbs.so.1, as the C compiler
// finds it.
func SystemLibrary() (string, error) {
	if _, err := exec.LookPath("gcc"); err != nil {
		return "", fmt.Errorf("%w: %v", ErrNoRDMACore, err)
	}
	out, err := exec.Command("gcc", "-print-file-name=libibverbs.so.1").Output()
	p := strings.TrimSpace(string(out))
	if err != nil || !filepath.IsAbs(p) {
		return "", fmt.Errorf("%w: gcc does not find libibverbs.so.1", ErrNoRDMACore)
	}
	if !headersFound() {
		return "", fmt.Errorf("%w: the C compiler finds no infiniband/verbs.h", ErrNoRDMACore)
	}
	return p, nil
}

// headersFound reports whether the C compiler finds infiniband/verbs.h.
func headersFound() bool {
	cmd := exec.Command("gcc", "-E", "-x", "c", "-", "-o", os.DevNull)
	cmd.Stdin = strings.NewReader("#include <infiniband/verbs.h>\n")
	return cmd.Run() == nil
}
