package deploytest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/objectmeta"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	k8svalidation "k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

// crdVersion is one served version of a vendored CRD, compiled once.
type crdVersion struct {
	gvk        schema.GroupVersionKind
	structural *structuralschema.Structural
	schema     validation.SchemaValidator
	cel        *cel.Validator // nil: the schema has no x-kubernetes-validations
}

// loadCRDs compiles every served version of every CRD in dir, keyed by the
// kind each serves. A schema that is not structural fails here, as the API
// server would refuse the CRD.
func loadCRDs(dir string) (map[schema.GroupVersionKind]*crdVersion, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		return nil, err
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("load CRDs: none in %s", dir)
	}
	out := make(map[schema.GroupVersionKind]*crdVersion)
	for _, p := range paths {
		raw, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		var crd apiextensionsv1.CustomResourceDefinition
		if err := yaml.UnmarshalStrict(raw, &crd); err != nil {
			return nil, fmt.Errorf("load CRD %s: %w", p, err)
		}
		for _, v := range crd.Spec.Versions {
			if !v.Served || v.Schema == nil || v.Schema.OpenAPIV3Schema == nil {
				continue
			}
			gvk := schema.GroupVersionKind{Group: crd.Spec.Group, Version: v.Name, Kind: crd.Spec.Names.Kind}
			var internal apiextensions.JSONSchemaProps
			if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, &internal, nil); err != nil {
				return nil, fmt.Errorf("load CRD %s %s: %w", p, gvk, err)
			}
			s, err := structuralschema.NewStructural(&internal)
			if err != nil {
				return nil, fmt.Errorf("load CRD %s %s: %w", p, gvk, err)
			}
			if errs := structuralschema.ValidateStructural(field.NewPath("openAPIV3Schema"), s); len(errs) > 0 {
				return nil, fmt.Errorf("load CRD %s %s: not structural: %w", p, gvk, errs.ToAggregate())
			}
			sv, _, err := validation.NewSchemaValidator(&internal)
			if err != nil {
				return nil, fmt.Errorf("load CRD %s %s: %w", p, gvk, err)
			}
			out[gvk] = &crdVersion{
				gvk:        gvk,
				structural: s,
				schema:     sv,
				cel:        cel.NewValidator(s, true, celconfig.PerCallLimit),
			}
		}
	}
	return out, nil
}

// check validates obj, a custom resource of c's kind, in the order the API
// server takes for a create with fieldValidation=Strict (kubectl's default):
// unknown fields (pruning), metadata, defaults, the OpenAPI schema (types,
// required fields, enums, bounds, patterns), list types, then the CEL rules
// under the per-object cost budget. obj is defaulted in place. Each problem
// is one string naming its field.
func (c *crdVersion) check(ctx context.Context, obj map[string]any) []string {
	var errs []string
	// PruneWithOptions removes what the schema does not know and returns
	// the paths it removed: the fields a strict create rejects.
	unknown := pruning.PruneWithOptions(obj, c.structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})
	sort.Strings(unknown)
	for _, p := range unknown {
		errs = append(errs, fmt.Sprintf("unknown field %q", p))
	}
	if err := objectmeta.Coerce(field.NewPath("metadata"), obj, c.structural, true, false); err != nil {
		errs = append(errs, err.Error())
	}
	errs = append(errs, metadataErrors(obj)...)
	defaulting.Default(obj, c.structural)
	for _, e := range validation.ValidateCustomResource(nil, obj, c.schema) {
		errs = append(errs, e.Error())
	}
	for _, e := range listtype.ValidateListSetsAndMaps(nil, c.structural, obj) {
		errs = append(errs, e.Error())
	}
	if c.cel != nil {
		celErrs, _ := c.cel.Validate(ctx, nil, c.structural, obj, nil, celconfig.RuntimeCELCostBudget)
		for _, e := range celErrs {
			errs = append(errs, e.Error())
		}
	}
	return errs
}

// metadataErrors checks what every object needs whatever its kind: a name
// that is a DNS subdomain (a namespaced object's namespace comes from
// kubectl or helm).
func metadataErrors(obj map[string]any) []string {
	md, _ := obj["metadata"].(map[string]any)
	name, _ := md["name"].(string)
	if name == "" {
		return []string{"metadata.name: Required value"}
	}
	if msgs := k8svalidation.IsDNS1123Subdomain(name); len(msgs) > 0 {
		return []string{fmt.Sprintf("metadata.name: Invalid value %q: %v", name, msgs)}
	}
	return nil
}

// document is one YAML document of a manifest stream: its source (file and
// index, for messages), its JSON and its decoded object.
type document struct {
	source string
	json   []byte
	obj    map[string]any
}

// gvk is the document's apiVersion and kind.
func (d document) gvk() schema.GroupVersionKind {
	av, _ := d.obj["apiVersion"].(string)
	k, _ := d.obj["kind"].(string)
	return schema.FromAPIVersionAndKind(av, k)
}

// name is the document's metadata.name.
func (d document) name() string {
	md, _ := d.obj["metadata"].(map[string]any)
	n, _ := md["name"].(string)
	return n
}

// readDocuments splits a YAML stream into its non-empty documents. A
// duplicate key is an error, as it is to a strict create.
func readDocuments(source string, r io.Reader) ([]document, error) {
	yr := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var docs []document
	for i := 0; ; i++ {
		raw, err := yr.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: read document %d: %w", source, i, err)
		}
		j, err := yaml.YAMLToJSONStrict(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", source, i, err)
		}
		if bytes.Equal(bytes.TrimSpace(j), []byte("null")) {
			continue // comments only, or an empty document
		}
		var obj map[string]any
		// utiljson keeps integers as int64, as the API server decodes them.
		if err := utiljson.Unmarshal(j, &obj); err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", source, i, err)
		}
		docs = append(docs, document{source: fmt.Sprintf("%s#%d", source, i), json: j, obj: obj})
	}
}
