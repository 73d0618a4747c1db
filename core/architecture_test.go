package core

import (
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// The file structure of this package (ARCHITECTURE.md, "Core file
// floors"): a file uses only files on floors below its own, except for the
// few arrows back up that the drawing lists, each with its reason. So the
// file graph has no cycle but those, and a reader can take the files
// bottom-up. A file uses another when it names something declared there
// (a type, function, method, field, constant or variable), found by
// type-checking the package's non-test files.

// maxArrowsUp bounds the arrows back up the drawing may list.
const maxArrowsUp = 6

// floorsHeading is the heading the drawing follows in ARCHITECTURE.md.
const floorsHeading = "### Core file floors"

// drawing is ARCHITECTURE.md's floors block, read.
type drawing struct {
	floor map[string]int       // file -> floor (1 is the bottom)
	up    map[[2]string]string // allowed arrow back up (from, to) -> why
	bad   []string             // lines that could not be read
	order []string             // files in the order drawn, for messages
}

// readDrawing reads the first ```text block after floorsHeading: lines
// "N  a.go  b.go ..." (floor N, top floor first) and lines
// "up  a.go -> b.go: why".
func readDrawing(text string) drawing {
	d := drawing{floor: map[string]int{}, up: map[[2]string]string{}}
	_, section, ok := strings.Cut(text, floorsHeading)
	if !ok {
		d.bad = append(d.bad, fmt.Sprintf("no heading %q", floorsHeading))
		return d
	}
	_, block, ok := strings.Cut(section, "```text\n")
	block, _, closed := strings.Cut(block, "```")
	if !ok || !closed {
		d.bad = append(d.bad, "no ```text block after "+floorsHeading)
		return d
	}
	for _, line := range strings.Split(block, "\n") {
		fields := strings.Fields(line)
		switch {
		case len(fields) == 0:
		case fields[0] == "up":
			arrow, why, _ := strings.Cut(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(line), "up")), ":")
			from, to, ok := strings.Cut(arrow, "->")
			from, to, why = strings.TrimSpace(from), strings.TrimSpace(to), strings.TrimSpace(why)
			if !ok || from == "" || to == "" || why == "" {
				d.bad = append(d.bad, fmt.Sprintf("%q: want \"up  a.go -> b.go: why\"", line))
				continue
			}
			d.up[[2]string{from, to}] = why
		default:
			n, err := strconv.Atoi(fields[0])
			if err != nil || n < 1 {
				d.bad = append(d.bad, fmt.Sprintf("%q: want a floor number (1 or more) and its files", line))
				continue
			}
			for _, f := range fields[1:] {
				if _, twice := d.floor[f]; twice {
					d.bad = append(d.bad, f+" is drawn twice")
				}
				d.floor[f] = n
				d.order = append(d.order, f)
			}
		}
	}
	return d
}

// violations lists where the file graph (file -> files it uses) and the
// drawing disagree.
func violations(graph map[string]map[string]int, d drawing) []string {
	bad := append([]string(nil), d.bad...)
	var files []string
	for f := range graph {
		files = append(files, f)
	}
	sort.Strings(files)
	for _, f := range files {
		if _, ok := d.floor[f]; !ok {
			bad = append(bad, f+" is not drawn")
		}
	}
	for _, f := range d.order {
		if _, ok := graph[f]; !ok {
			bad = append(bad, f+" is drawn but is no file of the package")
		}
	}
	if len(d.up) > maxArrowsUp {
		bad = append(bad, fmt.Sprintf("%d arrows back up are listed; at most %d", len(d.up), maxArrowsUp))
	}
	for arrow := range d.up {
		from, to := arrow[0], arrow[1]
		if graph[from][to] == 0 || d.floor[to] < d.floor[from] {
			bad = append(bad, fmt.Sprintf("up %s -> %s is listed, but %s uses nothing of %s on its floor or above: remove the line", from, to, from, to))
		}
	}
	for _, f := range files {
		var used []string
		for g := range graph[f] {
			used = append(used, g)
		}
		sort.Strings(used)
		for _, g := range used {
			fl, gl := d.floor[f], d.floor[g]
			if g == f || fl == 0 || gl == 0 || gl < fl {
				continue
			}
			if _, ok := d.up[[2]string{f, g}]; ok {
				continue
			}
			bad = append(bad, fmt.Sprintf("%s (floor %d) uses %s (floor %d) %d time(s)", f, fl, g, gl, graph[f][g]))
		}
	}
	return bad
}

// fileGraph type-checks files (one package) and returns, for every file,
// how many times it uses what each other file declares. Local variables,
// parameters and labels are no file's; fields and methods are their
// declaring file's.
func fileGraph(fset *token.FileSet, files []*ast.File) (map[string]map[string]int, error) {
	conf := types.Config{Importer: importer.ForCompiler(fset, "source", nil)}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	pkg, err := conf.Check(files[0].Name.Name, fset, files, info)
	if err != nil {
		return nil, err
	}
	name := func(p token.Pos) string { return filepath.Base(fset.Position(p).Filename) }
	graph := map[string]map[string]int{}
	for _, f := range files {
		graph[name(f.Pos())] = map[string]int{}
	}
	for id, obj := range info.Uses {
		if obj.Pkg() != pkg || !obj.Pos().IsValid() {
			continue
		}
		switch o := obj.(type) {
		case *types.Label:
			continue
		case *types.Var:
			if !o.IsField() && o.Parent() != pkg.Scope() {
				continue // a local variable or a parameter
			}
		case *types.Func: // a function or a method: its file's
		default:
			if obj.Parent() != pkg.Scope() {
				continue // a type or constant declared inside a function
			}
		}
		if from, to := name(id.Pos()), name(obj.Pos()); from != to {
			graph[from][to]++
		}
	}
	return graph, nil
}

// packageFiles parses the non-test files of the package in dir.
func packageFiles(fset *token.FileSet, dir string) ([]*ast.File, error) {
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, err
	}
	var files []*ast.File
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, n, nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	return files, nil
}

func TestFilesFollowTheDrawnFloors(t *testing.T) {
	text, err := os.ReadFile(filepath.Join("..", "ARCHITECTURE.md"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	files, err := packageFiles(fset, ".")
	if err != nil {
		t.Fatal(err)
	}
	graph, err := fileGraph(fset, files)
	if err != nil {
		t.Fatal(err)
	}
	if bad := violations(graph, readDrawing(string(text))); len(bad) > 0 {
		t.Fatalf("ARCHITECTURE.md's core file floors and the code disagree (put a declaration where its readers are, or draw the file where it belongs):\n%s", strings.Join(bad, "\n"))
	}
}

func TestTheFloorCheckerFindsArrowsUp(t *testing.T) {
	d := readDrawing(floorsHeading + "\n\n```text\n3  a.go\n2  b.go  c.go\n1  d.go\nup  d.go -> a.go: d calls back\n```\n")
	if len(d.bad) > 0 || d.floor["a.go"] != 3 || d.floor["c.go"] != 2 || d.floor["d.go"] != 1 || d.up[[2]string{"d.go", "a.go"}] != "d calls back" {
		t.Fatalf("read %+v", d)
	}
	ok := map[string]map[string]int{"a.go": {"b.go": 1, "d.go": 2}, "b.go": {"d.go": 1}, "c.go": {}, "d.go": {"a.go": 1}}
	if bad := violations(ok, d); len(bad) > 0 {
		t.Fatalf("a graph that follows the floors: %q", bad)
	}
	wrong := map[string]map[string]int{
		"a.go": {}, "b.go": {"c.go": 1}, "c.go": {"a.go": 2}, "d.go": {"b.go": 1}, "e.go": {},
	}
	want := []string{
		"e.go is not drawn",
		"up d.go -> a.go is listed, but d.go uses nothing of a.go on its floor or above: remove the line",
		"b.go (floor 2) uses c.go (floor 2) 1 time(s)",
		"c.go (floor 2) uses a.go (floor 3) 2 time(s)",
		"d.go (floor 1) uses b.go (floor 2) 1 time(s)",
	}
	if bad := violations(wrong, d); strings.Join(bad, "\n") != strings.Join(want, "\n") {
		t.Fatalf("got\n%s\nwant\n%s", strings.Join(bad, "\n"), strings.Join(want, "\n"))
	}
	for _, text := range []string{"no heading", floorsHeading + "\n```text\nx  a.go\nup  a.go b.go\n```\n", floorsHeading + "\n```text\n1  a.go\n2  a.go\n```\n"} {
		if d := readDrawing(text); len(d.bad) == 0 {
			t.Fatalf("%q read without complaint: %+v", text, d)
		}
	}
}

func TestTheFileGraphSeesEveryKindOfUse(t *testing.T) {
	src := map[string]string{
		"top.go": `package p
func top() int {
	var s shape          // a type
	s.side = limit       // a field, a constant
	n := s.area() + count // a method, a variable
	helper()             // a function
	return n
}`,
		"shape.go": `package p
type shape struct{ side int }
func (s shape) area() int { return s.side * s.side }`,
		"base.go": `package p
const limit = 3
var count int
func helper() { type local int; var x local; _ = x }`,
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range []string{"base.go", "shape.go", "top.go"} {
		f, err := parser.ParseFile(fset, name, src[name], 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	graph, err := fileGraph(fset, files)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]int{"top.go": {"shape.go": 3, "base.go": 3}, "shape.go": {}, "base.go": {}}
	if fmt.Sprint(graph) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", graph, want)
	}
}
