package calibrate

import "math"

// dim is the number of coefficients of each fitted time (see Model).
const dim = 4

// vec and mat are the estimator's vectors and matrices: fixed size, so an
// update allocates nothing.
type (
	vec [dim]float64
	mat [dim][dim]float64
)

func dot(a, b vec) float64 {
	s := 0.0
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// estimator fits y ≈ θ·x by weighted least squares with exponential
// forgetting, in information form, stabilised towards a prior:
//
//	R ← λ·R + (1−λ)·R₀ + w·x·xᵀ
//	b ← λ·b + (1−λ)·R₀·θ₀ + w·x·y
//	θ = R⁻¹·b
//
// R₀ = diag(prec) is the prior's information and θ₀ its mean. Without data
// θ = θ₀; at steady state R = R₀ + Σₖ λᵏ·wₖ·xₖ·xₖᵀ, so the prior keeps the
// weight of a few observations for ever (Kulhavý and Zarrop, "On a general
// concept of forgetting", Int. J. Control 58, 1993: stabilised forgetting)
// while recent data dominate, and a direction the data stop exciting drifts
// back to the prior instead of winding up — the failure of plain
// exponential-forgetting RLS (Ljung, "System Identification", §11.2) when
// every request is alike for a while.
//
// Observations are relative: x and y are divided by norm, the prior's
// prediction of y, so that a 10 ms prefill and a 10 s one count alike.
// Each is weighted by Huber's rule (Huber, "Robust Estimation of a Location
// Parameter", 1964) on its a-priori residual relative to the fit: beyond k
// robust scales the weight falls as k·s/|r|, so a prefill that waited
// behind work the router could not see moves the fit only a little.
//
// The solve is a 4×4 Cholesky factorisation: a few hundred flops per
// observation, none per routing decision.
type estimator struct {
	theta, prior, prec vec
	info               mat
	b                  vec
	forget             float64 // λ
	k                  float64 // Huber's threshold in robust scales
	scale              float64 // robust scale of relative residuals: EWMA of min(|r|, 4·scale)
	// errFit and errPrior are EWMAs of |ŷ/y − 1| for the fit (before the
	// observation updates it) and for the prior.
	errFit, errPrior float64
	// predSum, priorSum and obsSum are decaying sums (about the last 100
	// observations) of the fit's a-priori predictions, the prior's and the
	// observations, in seconds: their ratios say whether the fit agrees with
	// what the replica did over a stretch of its work, not only on average
	// per observation.
	predSum, priorSum, obsSum float64
	n                         int64 // observations used
}

// Robust-scale bounds and the EWMA rate of the error figures.
const (
	scaleInit  = 0.25
	scaleFloor = 0.02
	ewmaRate   = 0.05
	sumDecay   = 0.99
	// maxFeature bounds a normalised feature (a 1-token prefill's share of
	// a per-request constant can be huge): the estimate stays finite.
	maxFeature = 1e4
)

func newEstimator(prior, prec vec, forget, k float64) estimator {
	e := estimator{theta: prior, prior: prior, prec: prec, forget: forget, k: k, scale: scaleInit}
	for i := range prec {
		e.info[i][i] = prec[i]
		e.b[i] = prec[i] * prior[i]
	}
	return e
}

// update adds the observation y ≈ θ·x with weight w in (0, 1]; norm > 0 is
// the prior's prediction of y. It reports whether the observation was used
// (false for non-finite or non-positive input).
func (e *estimator) update(x vec, y, norm, w float64) bool {
	if !(norm > 0) || !(y > 0) || !(w > 0) || math.IsInf(y, 0) || math.IsInf(norm, 0) {
		return false
	}
	var xn vec
	for i := range x {
		v := x[i] / norm
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return false
		}
		xn[i] = math.Max(-maxFeature, math.Min(maxFeature, v))
	}
	yn := y / norm
	pred := dot(e.theta, xn)
	e.predSum = sumDecay*e.predSum + pred*norm
	e.priorSum = sumDecay*e.priorSum + dot(e.prior, xn)*norm
	e.obsSum = sumDecay*e.obsSum + y
	if e.n == 0 {
		e.errFit, e.errPrior = relErr(pred, yn), relErr(dot(e.prior, xn), yn)
	} else {
		e.errFit += ewmaRate * (relErr(pred, yn) - e.errFit)
		e.errPrior += ewmaRate * (relErr(dot(e.prior, xn), yn) - e.errPrior)
	}
	r := (yn - pred) / math.Max(math.Abs(pred), 0.05)
	ar := math.Abs(r)
	if lim := e.k * e.scale; ar > lim {
		w *= lim / ar
	}
	e.scale += ewmaRate * (math.Min(ar, 4*e.scale) - e.scale)
	e.scale = math.Max(e.scale, scaleFloor)

	l := e.forget
	for i := 0; i < dim; i++ {
		for j := 0; j < dim; j++ {
			e.info[i][j] = l*e.info[i][j] + w*xn[i]*xn[j]
		}
		e.info[i][i] += (1 - l) * e.prec[i]
		e.b[i] = l*e.b[i] + (1-l)*e.prec[i]*e.prior[i] + w*xn[i]*yn
	}
	if th, ok := solve(e.info, e.b); ok {
		e.theta = th
	}
	e.n++
	return true
}

// relErr is |pred/y − 1|, capped at 10 (a figure for dashboards, not an
// input to the fit).
func relErr(pred, y float64) float64 {
	if !(y > 0) {
		return 0
	}
	return math.Min(math.Abs(pred/y-1), 10)
}

// solve returns A⁻¹·b for a symmetric positive definite A by Cholesky
// factorisation, or false when A is not (numerically) positive definite.
func solve(a mat, b vec) (vec, bool) {
	var l mat
	for i := 0; i < dim; i++ {
		for j := 0; j <= i; j++ {
			s := a[i][j]
			for k := 0; k < j; k++ {
				s -= l[i][k] * l[j][k]
			}
			if i == j {
				if !(s > 0) {
					return vec{}, false
				}
				l[i][i] = math.Sqrt(s)
			} else {
				l[i][j] = s / l[j][j]
			}
		}
	}
	var y, x vec
	for i := 0; i < dim; i++ {
		s := b[i]
		for k := 0; k < i; k++ {
			s -= l[i][k] * y[k]
		}
		y[i] = s / l[i][i]
	}
	for i := dim - 1; i >= 0; i-- {
		s := y[i]
		for k := i + 1; k < dim; k++ {
			s -= l[k][i] * x[k]
		}
		x[i] = s / l[i][i]
	}
	for _, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return vec{}, false
		}
	}
	return x, true
}
