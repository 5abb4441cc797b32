package odp

import (
	"fmt"
	"go/ast"
	"go/build"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// floors are the package's files floor by floor, bottom first, as the package doc
// describes them: a file uses declarations of its own floor and of those below.
var floors = []struct {
	name  string
	files []string
}{
	{"vocabulary", []string{"errors.go", "access.go", "config.go", "faultmodel.go", "profile.go", "link.go", "qpstate.go",
		"wr.go", "wc.go", "caps.go", "stats.go", "keys.go", "procmem.go"}},
	{"the address space", []string{"space.go", "buffer.go", "filemap.go", "zapwindow.go"}},
	{"registration and faults", []string{"mr.go", "register.go", "notifier.go", "fault.go", "implicit.go",
		"file.go", "advise.go", "mw.go"}},
	{"DMA", []string{"dma.go", "latezap.go"}},
	{"the engine", []string{"cqring.go", "qpcontext.go", "srqcontext.go", "checks.go", "engine.go", "requester.go", "responder.go", "ud.go",
		"mwbind.go"}},
	{"verbs", []string{"device.go", "pd.go", "memory.go", "cq.go", "qp.go", "cm.go", "counters.go"}},
}

// TestFileFloors type-checks the package and fails on every use of a declaration
// from a floor above the user's, and on a file no floor lists.
func TestFileFloors(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("needs the go command for the dependencies' export data:", err)
	}
	floorOf := map[string]int{}
	for i, f := range floors {
		for _, name := range f.files {
			floorOf[name] = i
		}
	}
	bp, err := build.ImportDir(".", 0)
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range bp.GoFiles {
		if _, ok := floorOf[name]; !ok {
			t.Errorf("%s is on no floor: add it to floors and to the package doc", name)
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	for name := range floorOf {
		if !slices.Contains(bp.GoFiles, name) {
			t.Errorf("floors list %s, which the package does not have", name)
		}
	}

	out, err := exec.Command("go", "list", "-export", "-deps", "-f", "{{.ImportPath}}\t{{.Export}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	exports := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if path, file, ok := strings.Cut(line, "\t"); ok && file != "" {
			exports[path] = file
		}
	}
	lookup := func(path string) (io.ReadCloser, error) {
		file, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(file)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: importer.ForCompiler(fset, "gc", lookup)}
	pkg, err := conf.Check(bp.ImportPath, fset, files, info)
	if err != nil {
		t.Fatal(err)
	}

	up := map[[2]string]map[string]bool{}
	for id, obj := range info.Uses {
		if obj.Pkg() != pkg || !obj.Pos().IsValid() {
			continue
		}
		from := filepath.Base(fset.Position(id.Pos()).Filename)
		to := filepath.Base(fset.Position(obj.Pos()).Filename)
		if floorOf[to] > floorOf[from] {
			k := [2]string{from, to}
			if up[k] == nil {
				up[k] = map[string]bool{}
			}
			up[k][obj.Name()] = true
		}
	}
	var msgs []string
	for k, names := range up {
		var ns []string
		for n := range names {
			ns = append(ns, n)
		}
		sort.Strings(ns)
		msgs = append(msgs, fmt.Sprintf("%s (%s) uses %s (%s): %s", k[0], floors[floorOf[k[0]]].name, k[1],
			floors[floorOf[k[1]]].name, strings.Join(ns, " ")))
	}
	sort.Strings(msgs)
	for _, m := range msgs {
		t.Error(m)
	}
}
