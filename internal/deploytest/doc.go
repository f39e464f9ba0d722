// Package deploytest holds deploy/ to the APIs a cluster checks it against.
// Its tests validate every manifest in deploy/ and the rendered Helm chart
// (deploy/helm/prefixlb-epp, with helm on PATH) the way the API server does
// on create: custom resources against the released CRDs vendored in
// testdata/crds (unknown fields, defaults, the OpenAPI schema with its
// required fields, list types and the x-kubernetes-validations CEL rules,
// run by the API server's own code from k8s.io/apiextensions-apiserver), and
// built-in kinds by strict decoding into their Go types. They also check that
// the objects' references resolve: the InferencePool's endpoint picker is a
// Service port of the set, the HTTPRoute's backend an InferencePool of it.
//
// The package has no code outside its tests.
package deploytest
